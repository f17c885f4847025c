"""Batch input lines are split on b"\n" only: a raw line or paragraph separator inside a JSON
string (as ``json.dumps(ensure_ascii=False)`` writes it) stays in its line."""

from __future__ import annotations

import json

import pytest

from cloud_tier.gateway.batch.jsonl import validate

CHAT = "/v1/chat/completions"


@pytest.mark.parametrize("sep", ["\u2028", "\u2029", "\u0085", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e"])
def test_a_raw_separator_inside_a_string_does_not_split_the_line(sep):
    body = {"model": "m", "messages": [{"role": "user", "content": f"one{sep}two"}]}
    text = "".join(json.dumps({"custom_id": cid, "method": "POST", "url": CHAT, "body": body}, ensure_ascii=False)
                   + "\r\n" for cid in ("a", "b"))
    v = validate(text.encode(), CHAT, 10)
    assert v.errors == []
    assert [(ln.custom_id, ln.error) for ln in v.lines] == [("a", None), ("b", None)]
    assert v.lines[0].body["messages"][0]["content"] == f"one{sep}two"
