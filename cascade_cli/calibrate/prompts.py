"""The prompt sets ``cascade calibrate --prompts`` takes: generated tasks with answers, ShareGPT, or a
file (JSON lines with prompt/answer, or one prompt per line)."""

from __future__ import annotations

import random
from pathlib import Path

from cascade.eval.scoring import Task
from cascade.eval.tasks import generate
from cascade.wire import WireError, loads

MAX_LINE_BYTES = 1 << 20  # one prompt with its answer


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
    for number, line in enumerate(Path(source).read_text().split("\n"), 1):
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
    return Task(prompt, answer, kind or ("fact" if answer else "open"))
