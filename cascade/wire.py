"""One strict JSON decoder for data from outside: HTTP bodies and headers, MQTT payloads, a
worker's or a device's numbers, files another host wrote.

``loads(data, limit=...)`` gives the value or raises ``WireError`` (a ValueError) with a short
``reason`` code to count it by. Refused, whatever Python's ``json`` would take:

    too_large     more than ``limit`` bytes (checked before anything is decoded)
    encoding      bad UTF-8
    not_json      bad JSON (a byte order mark included), or nested deeper than ``max_depth``
    non_finite    NaN, Infinity, -Infinity, or a number beyond a float (1e999)
    int_range     an integer beyond 64 bits (what SQLite, Prometheus and timers take)
    surrogate     a lone UTF-16 surrogate escape (\\ud800): no encoder downstream takes one
    control_char  with ``text_safe``: a control character, a line separator or an invisible
                  format character (U+0000-U+001F, U+007F-U+009F, U+2028, U+2029, bidirectional
                  overrides and isolates, zero-width characters) in a key or a string, which would
                  forge a log line, split a record where a consumer splits lines, or make a table
                  show what it does not hold

Only this module calls ``json.loads`` on outside data; what the process wrote itself (its own
database rows) may be read with plain ``json``.

Speed: orjson parses first where its answer is certain to be this module's (it refuses NaN, the
infinities, 1e999, lone surrogates and bad UTF-8 itself; a document with a run of 19 digits, which
it might read as a float, more brackets than ``max_depth``, or ``text_safe``, takes the checked
path); whatever orjson refuses is decoded again by ``json`` with the checks, which names the
reason. A relayed stream's chunk decodes in ~1.5 us instead of ~16.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

try:
    import orjson
except ImportError:  # a core dependency; the checked path alone without it
    orjson = None

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_DEPTH = 32
# controls, line separators, and the invisible format characters that reorder or hide what a terminal
# shows (bidirectional overrides and isolates, zero-width characters, the BOM, interlinear annotation)
_UNSAFE_TEXT = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200b-\u200f\u202a-\u202e\u2060-\u2064"
                          "\u2066-\u2069\ufeff\ufff9-\ufffb]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_LONG_DIGITS = re.compile(rb"\d{19}")  # an integer near or past 64 bits (orjson would give a float past them)


class WireError(ValueError):
    """Outside data refused; ``reason`` is one of the codes in the module docstring."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _no_constant(name: str):
    raise WireError("non_finite", f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise WireError("non_finite", f"{text[:40]} is out of range for a number")
    return value


def _int64(text: str) -> int:
    if len(text) > 20:  # never parse a 4,000-digit integer only to refuse it
        raise WireError("int_range", f"the integer {text[:24]}... is beyond 64 bits")
    value = int(text)
    if not INT64_MIN <= value <= INT64_MAX:
        raise WireError("int_range", f"the integer {text} is beyond 64 bits")
    return value


_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float, parse_int=_int64)
_ANY_INT_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float)


def loads(data: bytes | bytearray | memoryview | str, *, limit: int, max_depth: int = MAX_DEPTH,
          text_safe: bool = False, int64: bool = True) -> Any:
    """Decode ``data`` as strict JSON (see the module docstring); WireError when refused. With
    ``int64`` False an integer of any size is kept (up to Python's 4,300 digits), for a caller whose
    schema then refuses it naming the field (an API's request body)."""
    size = len(data.encode("utf-8", "surrogatepass")) if isinstance(data, str) else len(data)
    if size > limit:
        raise WireError("too_large", f"{size} bytes is over the limit of {limit}")
    if orjson is not None and not text_safe and (value := _fast(data, max_depth, int64)) is not _SLOW:
        return value
    return _checked(data, max_depth, text_safe, int64)


def _checked(data: bytes | bytearray | memoryview | str, max_depth: int, text_safe: bool, int64: bool) -> Any:
    """``json`` with the checks: the path that names why a document is refused."""
    if isinstance(data, str):
        text = data
    else:
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise WireError("encoding", f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if text.startswith("\ufeff"):  # in json.loads' words
        raise WireError("not_json", str(json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)))
    try:
        value = (_DECODER if int64 else _ANY_INT_DECODER).decode(text)
    except WireError:
        raise
    except RecursionError:
        raise WireError("not_json", "nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, and int()'s own limit on digits
        raise WireError("not_json", f"not valid JSON: {e}") from None
    _check(value, max_depth, text_safe, bool(_SURROGATE_ESCAPE.search(text)))
    return value


_SLOW = object()


def _fast(data: bytes | bytearray | memoryview | str, max_depth: int, int64: bool) -> Any:
    """orjson's answer where it is certainly the checked path's, else ``_SLOW``."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if _LONG_DIGITS.search(raw):
        return _SLOW
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return _SLOW  # the checked path refuses it too, naming why
    if raw.count(b"{") + raw.count(b"[") > max_depth:
        _check(value, max_depth, False, False)
    return value


def _check(value: Any, max_depth: int, text_safe: bool, may_have_surrogates: bool) -> None:
    """Depth, and (when they may occur) lone surrogates and unsafe characters, in one walk."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            if depth > max_depth:
                raise WireError("not_json", f"nested deeper than {max_depth}")
            for k, item in v.items():
                _check_text(k, text_safe, may_have_surrogates)
                stack.append((item, depth + 1))
        elif isinstance(v, list):
            if depth > max_depth:
                raise WireError("not_json", f"nested deeper than {max_depth}")
            stack.extend((item, depth + 1) for item in v)
        elif isinstance(v, str):
            _check_text(v, text_safe, may_have_surrogates)


def _check_text(s: str, text_safe: bool, may_have_surrogates: bool) -> None:
    if text_safe and _UNSAFE_TEXT.search(s):
        raise WireError("control_char", "a string holds a control character or a line separator")
    if may_have_surrogates:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise WireError("surrogate", "a string holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                                         "escape)") from None


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float (at any depth) made None: what a process writes of
    numbers it computed from outside data, so that what it reads back is JSON everywhere."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def safe_text(s: str) -> bool:
    """Whether ``s`` holds no control character or line separator (what ``text_safe`` refuses)."""
    return _UNSAFE_TEXT.search(s) is None


def one_line(s: str, limit: int = 500) -> str:
    """``s`` with every control character and line separator made a space, cut to ``limit``
    characters: what a process says of itself in a field another one will check as text."""
    flat = _UNSAFE_TEXT.sub(" ", s)
    return flat if len(flat) <= limit else flat[:limit - 1] + "…"


def read_file(path, limit: int) -> bytes:
    """The bytes of the regular file at ``path``, read up to ``limit``: OSError for what is not a
    regular file (a FIFO would block forever, /dev/zero never end) or is longer than ``limit`` (said
    when found, never read whole). For files an operator names: a config's companion, a prompt set."""
    import os
    import stat

    with open(path, "rb", buffering=0, opener=lambda p, flags: os.open(p, flags | os.O_NONBLOCK)) as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{path} is not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(f"{path} is over the limit of {limit} bytes")
    return data
