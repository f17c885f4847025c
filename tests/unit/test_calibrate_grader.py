"""The code-problem grader: an answer's code block runs with hidden asserts in a child `python -I`
in a temporary directory, under a timeout and a memory limit. Right code passes; wrong code, an
infinite loop, a memory bomb, an early sys.exit, a syntax error, or code that deletes files in its
working directory each grade 0 within the timeout (and delete only in their own directory)."""

from __future__ import annotations

import random
import time

import pytest

from cascade.eval.code_tasks import code_task
from cascade.eval.sandbox import extract_code, grade, run_python

TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
TIMEOUT_S = 3.0


def block(code: str) -> str:
    return f"Here you go:\n```python\n{code}\n```\nThis adds two numbers."


def test_right_code_passes():
    assert grade(block("def add(a, b):\n    return a + b"), TESTS, TIMEOUT_S) == 1.0


@pytest.mark.parametrize("name,code", [
    ("wrong", "def add(a, b):\n    return a - b"),
    ("infinite_loop", "def add(a, b):\n    while True:\n        pass"),
    ("memory_bomb", "x = bytearray(1 << 34)\ndef add(a, b):\n    return a + b"),
    ("over_the_memory_limit", "x = bytearray(1 << 30)\ndef add(a, b):\n    return a + b"),  # 1 GiB > 256 MiB
    ("memory_bomb_growing", "x = []\nwhile True:\n    x.append(' ' * (1 << 20))"),
    ("sys_exit", "import sys\ndef add(a, b):\n    return a + b\nsys.exit(0)"),
    ("os_exit", "import os\ndef add(a, b):\n    return a + b\nos._exit(0)"),
    ("syntax_error", "def add(a, b)\n    return a + b"),
    ("no_function", "print('hello')"),
    ("fork_and_sleep", "import os, time\nif os.fork() == 0:\n    time.sleep(60)\ndef add(a, b):\n    while True: pass"),
    # a descendant that leaves the session keeps the output pipe open: grading once waited for it forever
    ("setsid_child_holds_the_pipe", "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(30)\n"
                                    "    os._exit(0)\ndef add(a, b):\n    return a + b"),
])
def test_bad_code_grades_zero_within_the_timeout(name, code):
    started = time.monotonic()
    assert grade(block(code), TESTS, TIMEOUT_S) == 0.0
    assert time.monotonic() - started < TIMEOUT_S + 2.0


def test_code_that_deletes_files_in_cwd_deletes_only_its_own(tmp_path, monkeypatch):
    keep = tmp_path / "keep.txt"
    keep.write_text("mine")
    monkeypatch.chdir(tmp_path)
    code = ("import os, shutil\nfor name in os.listdir('.'):\n    p = os.path.join('.', name)\n"
            "    shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)\nraise SystemExit(3)")
    assert run_python(code, TESTS, TIMEOUT_S).passed is False
    assert keep.read_text() == "mine"


def test_an_answer_without_a_code_block_has_no_code_and_a_cut_off_block_runs_to_the_end():
    assert extract_code("I think the answer is 5.") == ""
    assert extract_code("```python\ndef add(a, b):\n    return a + b") == "def add(a, b):\n    return a + b"
    assert extract_code("def add(a, b):\n    return a + b").startswith("def add")
    assert grade("I think the answer is 5.", TESTS, TIMEOUT_S) == 0.0


def test_the_reference_solutions_pass_their_own_hidden_asserts():
    """Each generated problem's asserts are consistent: a solution that looks them up passes."""
    rng = random.Random(5)
    for _ in range(25):
        task = code_task(rng)
        fn = task.prompt.split("`")[1].split("(")[0]
        table = {}
        for line in task.tests.splitlines():
            call, expected = line.removeprefix("assert ").split(" == ")
            table[call] = expected
        code = (f"_T = {table!r}\ndef {fn}(*args):\n    key = '{fn}(' + ', '.join(map(repr, args)) + ')'\n"
                "    return eval(_T[key])")
        assert task.score(block(code)) == 1.0, task.prompt
