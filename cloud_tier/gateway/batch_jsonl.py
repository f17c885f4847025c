"""The Batch API's JSONL, both ways, as OpenAI writes it: an input line is ``{"custom_id", "method":
"POST", "url", "body"}``; an output (or error) line is ``{"id", "custom_id", "response":
{"status_code", "request_id", "body"} | null, "error": {"code", "message"} | null}``.

Validation splits what is wrong with the file (a line without a ``custom_id``, two lines with the
same one, more lines than allowed, no line at all: the batch fails, with ``errors``, and runs
nothing) from what is wrong with one line (not JSON, not POST, the wrong ``url``, no ``body``
object: that line goes to the error file and the others run). Pure: no I/O."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
_DROPPED = ("stream", "stream_options", "priority_class")  # a line is answered whole, in the batch class


@dataclass(frozen=True)
class InputLine:
    """One request of a batch: ``body`` to run, or ``error`` ({code, message}) to report instead."""

    index: int  # 0-based among the file's non-blank lines: the order of the output
    custom_id: str | None
    body: dict | None = None
    error: dict | None = None


@dataclass(frozen=True)
class Validated:
    lines: list[InputLine]
    errors: list[dict]  # OpenAI's batch errors: {code, message, param, line}; any fails the batch


def count_lines(content: bytes) -> int:
    """Non-blank lines, cheaply (the size check at creation, before any parsing)."""
    return sum(1 for raw in content.splitlines() if raw.strip())


def validate(content: bytes, url: str, max_lines: int) -> Validated:
    """The requests of an input file for a batch on ``url``."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as e:
        return Validated([], [_file_error("invalid_file_encoding", f"The file is not UTF-8: {e}.")])
    lines: list[InputLine] = []
    problems: list[dict] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        line = _parse_line(len(lines), raw, url)
        lines.append(line)
        cid = line.custom_id
        if line.error is not None and line.error["code"] == "invalid_json_line":
            continue  # its custom_id is unknown: the error file reports it by position
        if not cid:
            problems.append(_file_error("missing_custom_id", "Each request needs a non-empty string custom_id.",
                                        "custom_id", number))
        elif cid in seen:
            problems.append(_file_error("duplicate_custom_id", f"The custom_id {cid!r} is also on line "
                                        f"{seen[cid]}; each request's custom_id must be unique.", "custom_id", number))
        else:
            seen[cid] = number
    if not lines:
        problems.append(_file_error("empty_file", "The input file has no requests."))
    if len(lines) > max_lines:
        problems.append(_file_error("too_many_requests", f"The input file has {len(lines)} requests; a batch "
                                    f"holds at most {max_lines}."))
    return Validated(lines, problems)


def _parse_line(index: int, raw: str, url: str) -> InputLine:
    try:
        obj = json.loads(raw)
    except ValueError as e:
        return InputLine(index, None, error=_error("invalid_json_line", f"This line is not valid JSON: {e}."))
    except RecursionError:
        return InputLine(index, None, error=_error("invalid_json_line", "This line is nested too deeply."))
    if not isinstance(obj, dict):
        return InputLine(index, None, error=_error("invalid_json_line", "This line is not a JSON object."))
    cid = obj.get("custom_id") if isinstance(obj.get("custom_id"), str) else None
    if obj.get("method") != "POST":
        return InputLine(index, cid, error=_error("invalid_method", "The method must be POST."))
    if obj.get("url") != url:
        return InputLine(index, cid, error=_error(
            "invalid_url", f"The url {obj.get('url')!r} is not this batch's endpoint {url}."))
    body = obj.get("body")
    if not isinstance(body, dict):
        return InputLine(index, cid, error=_error("invalid_body", "The body must be a JSON object."))
    return InputLine(index, cid, body={k: v for k, v in body.items() if k not in _DROPPED})


def _error(code: str, message: str) -> dict:
    return {"code": code, "message": message}


def _file_error(code: str, message: str, param: str | None = None, line: int | None = None) -> dict:
    return {"code": code, "message": message, "param": param, "line": line}


def output_line(custom_id: str | None, status_code: int | None = None, body: dict | None = None,
                request_id: str | None = None, error: dict | None = None) -> dict:
    """A line of the output or error file: a response (any status), or an error without one."""
    response = None if status_code is None else {
        "status_code": status_code, "request_id": request_id or uuid.uuid4().hex, "body": body}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}


def line_error(custom_id: str | None, code: str, message: str) -> dict:
    """The error-file line of a request that was not answered (expired, cancelled, unreadable)."""
    return output_line(custom_id, error=_error(code, message))


def to_jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line, separators=(",", ":"), ensure_ascii=False).encode() + b"\n" for line in lines)
