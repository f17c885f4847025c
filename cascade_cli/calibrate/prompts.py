"""The prompt sets ``cascade calibrate --prompts`` takes: generated tasks with answers, ShareGPT, or a
file (JSON lines with prompt/answer, or one prompt per line)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from cascade.eval.scoring import Task
from cascade.eval.tasks import generate


def load_prompts(source: str, n: int, seed: int) -> list[Task]:
    if source == "tasks":
        return generate(n, seed)
    if source == "sharegpt":
        from cascade.eval.sharegpt import load_conversations

        rng = random.Random(seed)
        convs = [c for c in load_conversations() if 10 < len(c[0]) < 600]
        return [Task(c[0]) for c in rng.sample(convs, min(n, len(convs)))]
    tasks = []
    for line in Path(source).read_text().splitlines():
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            d = json.loads(line)
            tasks.append(Task(d["prompt"], d.get("answer"), d.get("kind", "fact" if d.get("answer") else "open")))
        else:
            tasks.append(Task(line.strip()))
    return tasks[:n]
