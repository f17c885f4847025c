"""The edge agent's ``[cascade]`` thresholds (``CascadeConfig``), and the calibration a model
version carries: the thresholds ``cascade calibrate`` fitted for that model, checked once where
the version is published and again where it is applied, so a fleet never ships one a device
cannot use.

``check_calibration(table, base_dir)`` gives the calibration as a version's manifest keeps it:

- only the keys of ``[cascade]`` (``device`` is the device's own name: it never travels, and is
  dropped), each of its type and in its range (``CalibrationError`` names the key otherwise);
- a threshold switched off (``min_mean_logprob = -inf``, as ``cascade calibrate`` writes it) is
  ``null``, which JSON carries (an infinity it does not);
- ``difficulty_model`` is the model itself (``{"weights": {feature: w}, "bias": b}``), read from
  the file the table names (relative to ``base_dir``, the edge.toml's folder): the path of a file
  on the calibrating host would mean nothing on a device;
- ``router`` likewise is the router itself (``cascade.policy.router``'s JSON: both stages, both
  thresholds and the edge model it was calibrated for), validated strictly (``Router.from_json``).

``thresholds(calibration, current)`` is what an agent applies: the ``CascadeConfig`` with the
calibration's values (``null``: the threshold off) and the difficulty model left for the caller
to write to a file of its own.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from cascade import wire
from cascade.policy.router import Router, RouterError

MAX_DIFFICULTY_FEATURES = 64
MAX_ROUTER_BYTES = 1 << 20  # a router is a few KB; a file larger than this is refused unread


class CalibrationError(ValueError):
    """A calibration a device could not apply; the message names the key."""


@dataclass
class CascadeConfig:
    """When the agent escalates to ``[upstream]`` (see cascade/policy). Written by
    ``cascade calibrate``; every key also from CASCADE_EDGE_CASCADE_<KEY>."""

    mode: str = "auto"  # default per request: auto | local | cloud
    offline: str = "local"  # when the cloud cannot be reached: queue | local | fail
    device: str = ""  # this device's name, sent upstream as X-Cascade-Device
    hold_tokens: int = 16  # K: tokens judged (and held back when streaming) before committing locally
    min_mean_logprob: float = -math.inf  # low confidence: mean logprob of the first K tokens below this
    min_token_logprob: float = -math.inf  # ... or any of them below this
    max_mean_entropy: float = math.inf  # ... or their mean entropy (nats) above this
    max_prompt_tokens: int = 0  # hard: prompts longer than this go up (0: only the context limits)
    difficulty_threshold: float = 1.01  # hard: learned difficulty above this goes up (> 1: off)
    difficulty_model: str = ""  # JSON written by `cascade calibrate`
    router: str = ""  # the two-stage router's JSON written by `cascade calibrate` ("": none)
    latency_budget_s: float = 0.0  # overflow: default budget per request (0: none)
    # structured outputs (response_format, tools): held to their grammar on the device (true), or generated
    # freely and checked afterwards (false: an answer that breaks its contract escalates "schema_invalid")
    constrain: bool = True

    def __post_init__(self):
        if self.mode not in ("auto", "local", "cloud"):
            raise ValueError(f"mode must be auto, local or cloud, got {self.mode!r}")
        if self.offline not in ("queue", "local", "fail"):
            raise ValueError(f"offline must be queue, local or fail, got {self.offline!r}")
        if not 1 <= self.hold_tokens <= 4096:
            raise ValueError("hold_tokens must be in 1..4096")
        for name in ("min_mean_logprob", "min_token_logprob", "max_mean_entropy"):  # any number: above 0 (or
            if math.isnan(getattr(self, name)):  # below) forces every answer to count as unsure, which has its uses
                raise ValueError(f"{name} must be a number (-inf or inf: off), not NaN")
        if not 0 <= self.max_prompt_tokens <= 10**7:
            raise ValueError("max_prompt_tokens must be in 0..10000000")
        if not (math.isfinite(self.difficulty_threshold) and 0 <= self.difficulty_threshold <= 100):
            raise ValueError("difficulty_threshold must be in 0..100 (above 1: off)")
        if not (math.isfinite(self.latency_budget_s) and 0 <= self.latency_budget_s <= 86400):
            raise ValueError("latency_budget_s must be in 0..86400")
        if self.router:  # read and checked now, so an agent with a bad one refuses to start
            load_router(Path(self.router).expanduser())


_FIELDS = {f.name: f for f in dataclasses.fields(CascadeConfig)}
_TYPES = {"mode": str, "offline": str, "hold_tokens": int, "min_mean_logprob": float, "min_token_logprob": float,
          "max_mean_entropy": float, "max_prompt_tokens": int, "difficulty_threshold": float,
          "latency_budget_s": float}
CALIBRATED = (*_TYPES, "difficulty_model", "router")  # what a version's calibration may set
NOT_CARRIED = ("device", "constrain")


def check_calibration(table: dict, base_dir: Path | None = None) -> dict:
    """``table`` (a ``[cascade]`` table, or a calibration as a manifest keeps it) as a manifest
    keeps it; CalibrationError naming the first key a device could not apply. A
    ``difficulty_model`` path is read only with ``base_dir`` (the table came from a file here)."""
    if not isinstance(table, dict):
        raise CalibrationError("a calibration is a table of [cascade] thresholds")
    out: dict = {}
    for key, value in table.items():
        if key in NOT_CARRIED:
            continue
        if key not in CALIBRATED:
            raise CalibrationError(f"calibration key {str(key)[:64]!r} is not a [cascade] threshold "
                                   f"(one of {', '.join(CALIBRATED)})")
        if key == "difficulty_model":
            out[key] = _difficulty_model(value, base_dir)
        elif key == "router":
            out[key] = _router(value, base_dir)
        else:
            out[key] = _value(key, value)
    try:  # the dataclass's own checks: ranges and choices, as an agent's config gets them
        thresholds(out, CascadeConfig())
    except ValueError as e:
        raise CalibrationError(f"calibration: {e}") from None
    if not any(k in out for k in CALIBRATED):
        raise CalibrationError("the calibration has no [cascade] thresholds")
    return out


def thresholds(calibration: dict, current: CascadeConfig) -> CascadeConfig:
    """``current`` with a checked calibration's thresholds (``null``: the field's default, off);
    ``difficulty_model`` and ``router`` are left as they are (the caller writes the inline models
    to files)."""
    changes = {k: (_FIELDS[k].default if v is None else v) for k, v in calibration.items()
               if k in _TYPES}
    return dataclasses.replace(current, **changes)


def _value(key: str, value):
    kind = _TYPES[key]
    if value is None:
        if kind is float:
            return None  # off
        raise CalibrationError(f"calibration key {key!r} cannot be null")
    if kind is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise CalibrationError(f"calibration key {key!r} must be an integer, not {value!r}"[:200])
        return value
    if kind is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            raise CalibrationError(f"calibration key {key!r} must be a number, not {value!r}"[:200])
        if math.isinf(value):
            off = _FIELDS[key].default
            if value != off:
                raise CalibrationError(f"calibration key {key!r} cannot be {value} (off is {off})")
            return None
        return float(value)
    if not isinstance(value, str):
        raise CalibrationError(f"calibration key {key!r} must be a string, not {value!r}"[:200])
    return value


def _difficulty_model(value, base_dir: Path | None) -> dict | None:
    if value in ("", None):
        return None
    if isinstance(value, str):
        if base_dir is None:
            raise CalibrationError("calibration key 'difficulty_model' names a file, which a device does not have: "
                                   "send the model itself ({\"weights\": {...}, \"bias\": ...}); cascade fleet push "
                                   "--calibration edge.toml reads the file it names")
        path = Path(value).expanduser()
        path = path if path.is_absolute() else base_dir / path
        try:
            value = wire.loads(wire.read_file(path, 1 << 20), limit=1 << 20)
        except OSError as e:
            raise CalibrationError(f"difficulty_model {str(path)!r} cannot be read: {e.strerror or e}") from None
        except wire.WireError as e:
            raise CalibrationError(f"difficulty_model {str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(value, dict) or set(value) - {"weights", "bias"}:
        raise CalibrationError("difficulty_model must be {\"weights\": {feature: weight}, \"bias\": number}")
    weights, bias = value.get("weights", {}), value.get("bias", 0.0)
    if not isinstance(weights, dict) or len(weights) > MAX_DIFFICULTY_FEATURES:
        raise CalibrationError(f"difficulty_model weights must be a map of at most {MAX_DIFFICULTY_FEATURES} "
                               "features to numbers")
    for name, w in [*weights.items(), ("bias", bias)]:
        if not isinstance(name, str) or len(name) > 64 or not isinstance(w, (int, float)) or isinstance(w, bool) \
                or not math.isfinite(w):
            raise CalibrationError(f"difficulty_model {str(name)[:64]!r} must be a finite number")
    return {"weights": {k: float(w) for k, w in weights.items()}, "bias": float(bias)}


def load_router(path: Path) -> Router:
    """The router in the JSON file at ``path``; ValueError naming the key (``router``, or the
    router's own key) when it cannot be read or is not a valid router."""
    try:  # bounded while read: a FIFO, /dev/zero or a huge file is refused, never read whole
        return parse_router(wire.loads(wire.read_file(path, MAX_ROUTER_BYTES), limit=MAX_ROUTER_BYTES))
    except OSError as e:
        raise ValueError(f"router: {str(path)!r} cannot be read: {e.strerror or e}") from None
    except wire.WireError as e:
        raise ValueError(f"router: {str(path)!r} is not valid JSON: {e}") from None


def parse_router(value) -> Router:
    try:
        return Router.from_json(value)
    except RouterError as e:
        raise ValueError(str(e)) from None


def _router(value, base_dir: Path | None) -> dict | None:
    if value in ("", None):
        return None
    if isinstance(value, str):
        if base_dir is None:
            raise CalibrationError("calibration key 'router' names a file, which a device does not have: send "
                                   "the router itself; cascade fleet push --calibration edge.toml reads the file "
                                   "it names")
        path = Path(value).expanduser()
        try:
            return load_router(path if path.is_absolute() else base_dir / path).to_json()
        except ValueError as e:
            raise CalibrationError(f"calibration key {e}") from None
    try:
        return parse_router(value).to_json()
    except ValueError as e:
        raise CalibrationError(f"calibration key {e}") from None
