"""The Batch API's JSONL, both ways, as OpenAI writes it: an input line is ``{"custom_id", "method":
"POST", "url", "body"}``; an output (or error) line is ``{"id", "custom_id", "response":
{"status_code", "request_id", "body"} | null, "error": {"code", "message"} | null}``.

Validation splits what is wrong with the file (a line without a ``custom_id``, two lines with the
same one, more lines than allowed, no line at all, bad UTF-8: the batch fails, with ``errors``,
and runs nothing) from what is wrong with one line (not JSON, too long, not POST, the wrong
``url``, no ``body`` object: that line goes to the error file and the others run). The file comes
as chunks and is read a line at a time (``raw_lines``: split on b"\\n" only, so a raw U+2028 or
U+0085 in a string stays in its line; each line decoded by ``cascade.wire``): memory holds one
line, never the file's lines. Pure: no I/O."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from cascade import wire

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
_DROPPED = ("stream", "stream_options", "priority_class")  # a line is answered whole, in the batch class
MAX_LINE_BYTES = 4 << 20  # a line is a request: as long as a request body may be
_MAX_DEPTH = 100  # as a request body's (cascade.web.requests.BODY_MAX_DEPTH)
_MAX_ERRORS = 100  # a file's errors reported (the count of the rest in one more)


class TooLong(bytes):
    """A line over the line limit, its bytes dropped as they came."""


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


def raw_lines(chunks: Iterable[bytes], max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[bytes]:
    """The lines of a file given as chunks, split on b"\\n" only (a trailing b"\\r" dropped): one
    line held at a time; a line over ``max_line_bytes`` comes as an empty ``TooLong``."""
    pending: list[bytes] = []
    size = 0
    for chunk in chunks:
        parts = chunk.split(b"\n")
        for part in parts[:-1]:
            if pending:
                size += len(part)
                line = TooLong() if size > max_line_bytes else b"".join((*pending, part))
                pending, size = [], 0
            else:
                line = TooLong() if len(part) > max_line_bytes else part
            yield line[:-1] if line.endswith(b"\r") else line
        size += len(parts[-1])
        if size <= max_line_bytes:
            pending.append(parts[-1])
        else:
            pending = [b""]
    if size:
        yield TooLong() if size > max_line_bytes else b"".join(pending).removesuffix(b"\r")


def count_lines(chunks: Iterable[bytes], max_line_bytes: int = MAX_LINE_BYTES) -> int:
    """Non-blank lines, streaming (the size check at creation, before any parsing)."""
    return sum(1 for raw in raw_lines(chunks, max_line_bytes) if isinstance(raw, TooLong) or raw.strip())


def file_errors(chunks: Iterable[bytes], url: str, max_lines: int, max_line_bytes: int = MAX_LINE_BYTES
                ) -> list[dict]:
    """What fails the whole file, read once (memory: a digest per custom_id, the errors)."""
    problems: list[dict] = []
    seen: dict[bytes, int] = {}
    n = 0
    for number, line in _numbered(raw_lines(chunks, max_line_bytes)):
        n += 1
        try:
            parsed = _parse_line(n - 1, line, url)
        except UnicodeDecodeError as e:
            return [_file_error("invalid_file_encoding", f"Line {number} is not UTF-8: {e}.", None, number)]
        cid = parsed.custom_id
        if parsed.error is not None and parsed.error["code"] in ("invalid_json_line", "line_too_long"):
            continue  # its custom_id is unknown: the error file reports it by position
        digest = hashlib.blake2b(cid.encode(), digest_size=16).digest() if cid else b""
        if not cid:
            problems.append(_file_error("missing_custom_id", "Each request needs a non-empty string custom_id.",
                                        "custom_id", number))
        elif digest in seen:
            problems.append(_file_error("duplicate_custom_id", f"The custom_id {cid[:200]!r} is also on line "
                                        f"{seen[digest]}; each request's custom_id must be unique.", "custom_id",
                                        number))
        else:
            seen[digest] = number
        if len(problems) > _MAX_ERRORS:
            break
    if n == 0:
        problems.append(_file_error("empty_file", "The input file has no requests."))
    if n > max_lines:
        problems.append(_file_error("too_many_requests", f"The input file has {n} requests; a batch "
                                    f"holds at most {max_lines}."))
    return problems[:_MAX_ERRORS]


def parse_lines(chunks: Iterable[bytes], url: str, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[InputLine]:
    """The requests of a file that passed ``file_errors``, one at a time."""
    for index, (_, line) in enumerate(_numbered(raw_lines(chunks, max_line_bytes))):
        try:
            yield _parse_line(index, line, url)
        except UnicodeDecodeError:
            yield InputLine(index, None, error=_error("invalid_json_line", "This line is not UTF-8."))


def validate(content: bytes, url: str, max_lines: int) -> Validated:
    """Both passes over a file held whole: for small files and tests (the runner streams)."""
    errors = file_errors([content], url, max_lines)
    return Validated(list(parse_lines([content], url)), errors)


def _numbered(lines: Iterator[bytes]) -> Iterator[tuple[int, bytes]]:
    """The non-blank lines with their 1-based line numbers in the file."""
    for number, line in enumerate(lines, 1):
        if isinstance(line, TooLong) or line.strip():
            yield number, line


def _parse_line(index: int, raw: bytes, url: str) -> InputLine:
    """One line; UnicodeDecodeError when it is not UTF-8 (a fault of the file's)."""
    if isinstance(raw, TooLong):
        return InputLine(index, None, error=_error("line_too_long", "This line is longer than a request may be."))
    try:
        obj = wire.loads(raw, limit=len(raw), max_depth=_MAX_DEPTH, int64=False)
    except wire.WireError as e:
        if e.reason == "encoding":
            raise UnicodeDecodeError("utf-8", bytes(raw[:64]), 0, 1, str(e)) from e
        return InputLine(index, None, error=_error("invalid_json_line", f"This line is not valid JSON: {e}."))
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
