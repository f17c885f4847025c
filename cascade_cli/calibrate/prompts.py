"""The prompt sets ``cascade calibrate --prompts`` takes: generated tasks with answers, ShareGPT, or a
file (JSON lines with prompt/answer, or one prompt per line)."""

from __future__ import annotations

import math
import random
from pathlib import Path

from cascade.eval.scoring import Task
from cascade.eval.tasks import generate
from cascade.wire import WireError, loads, read_file

MAX_LINE_BYTES = 1 << 20  # one prompt with its answer
MAX_FILE_BYTES = 256 << 20  # a prompt set


def load_prompts(source: str, n: int, seed: int) -> list[Task]:
    if source == "tasks":
        return generate(n, seed)
    if source == "sharegpt":
        from cascade.eval.sharegpt import load_conversations

        rng = random.Random(seed)
        convs = [c for c in load_conversations() if 10 < len(c[0]) < 600]
        return [Task(c[0]) for c in rng.sample(convs, min(n, len(convs)))]
    tasks = []
    # lines end at "\n" alone: splitlines() would also cut a prompt at U+2028 or U+0085 inside it
    try:  # bounded while read: a FIFO or /dev/zero is refused, never read whole
        text = read_file(Path(source), MAX_FILE_BYTES).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{source}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        tasks.append(_json_task(line, f"{source}:{number}") if line.lstrip().startswith("{") else Task(line.strip()))
    return tasks[:n]


def _json_task(line: str, where: str) -> Task:
    """One JSON line through the strict decoder; ValueError naming the line if it is not a task."""
    try:
        d = loads(line, limit=MAX_LINE_BYTES)
    except WireError as e:
        raise ValueError(f"{where}: not a JSON line ({e})") from None
    prompt, answer, kind = d.get("prompt"), d.get("answer"), d.get("kind")
    if not isinstance(prompt, str) or not isinstance(answer, str | None) or not isinstance(kind, str | None):
        raise ValueError(f"{where}: a JSON line needs a string \"prompt\" (and a string \"answer\" and \"kind\" "
                         "if it has them)")
    if not prompt.strip() or (answer is not None and not answer.strip()):
        raise ValueError(f"{where}: \"prompt\" and \"answer\" must not be empty (an empty answer would match any)")
    kind = kind or ("fact" if answer else "open")
    if kind in ("arithmetic", "conversion") and answer is not None and not _number(answer):
        raise ValueError(f"{where}: a {kind} task's \"answer\" must be a number, not {answer[:40]!r}")
    return Task(prompt, answer, kind)


def _number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False
