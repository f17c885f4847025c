"""`cascade calibrate --prompts FILE` reads the user's file through the strict decoder: a bad JSON line is
refused naming its line, and a prompt with U+2028 inside stays one prompt."""

import pytest

from cascade_cli.calibrate.prompts import load_prompts


def test_json_lines_and_plain_lines_become_tasks(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "2+2?", "answer": "4"}\nwhat is\u2028a kiosk?\n\n{"prompt": "hi", "kind": "open"}\n')
    tasks = load_prompts(str(f), 10, 0)
    assert [(t.prompt, t.answer, t.kind) for t in tasks] == [
        ("2+2?", "4", "fact"), ("what is\u2028a kiosk?", None, "open"), ("hi", None, "open")]


@pytest.mark.parametrize("line", ['{"prompt": NaN}', '{"prompt": 1e999}', '{"prompt": "a"', '{"answer": "4"}',
                                  '{"prompt": ["a"]}', '{"prompt": "a", "answer": 4}'])
def test_a_bad_json_line_is_refused_naming_its_line(tmp_path, line):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:2: "):
        load_prompts(str(f), 10, 0)


@pytest.mark.parametrize("line", ['{"prompt": "", "answer": "4"}', '{"prompt": "2+2?", "answer": ""}',
                                  '{"prompt": "2+2?", "answer": "abc", "kind": "arithmetic"}',
                                  '{"prompt": "km?", "answer": "inf", "kind": "conversion"}'])
def test_a_task_that_could_not_be_scored_is_refused_at_load_naming_its_line(tmp_path, line):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:2: "):
        load_prompts(str(f), 10, 0)


def test_what_is_not_a_regular_file_is_refused_not_read(tmp_path):
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/zero"):  # a FIFO would block forever, /dev/zero never end
        with pytest.raises(OSError, match="not a regular file"):
            load_prompts(str(path), 10, 0)
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9?\n")
    with pytest.raises(ValueError, match="not UTF-8"):
        load_prompts(str(tmp_path / "bad.txt"), 10, 0)
