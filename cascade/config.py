"""Configuration shared by every deployable: one TOML file each, every key overridable.

A deployable's config is a dataclass whose fields are section dataclasses. Values come, in
increasing precedence, from the dataclass defaults, the TOML file, environment variables
``CASCADE_<DEPLOYABLE>_<SECTION>_<KEY>`` and explicit overrides (command-line flags).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class ConfigError(ValueError):
    """A configuration value is missing, unknown or of the wrong type."""


def cascade_home() -> Path:
    """Where every deployable keeps its state (queues, keys, registry, model cache)."""
    return Path(os.environ.get("CASCADE_HOME") or Path.home() / ".cascade").expanduser()


def load_config(
    cls: type[T],
    deployable: str,
    path: str | os.PathLike[str] | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
    environ: typing.Mapping[str, str] | None = None,
) -> T:
    """Build ``cls`` from defaults, the TOML file at ``path``, the environment and ``overrides``."""
    values: dict[str, dict[str, Any]] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                values = tomllib.load(f)
        except FileNotFoundError as e:
            raise ConfigError(f"config file not found: {path}") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from e
    sections = _section_types(cls)
    for section, table in values.items():
        if section not in sections or not isinstance(table, dict):
            raise ConfigError(f"unknown config section [{section}] in {path}")
    from_env = _from_environ(sections, deployable, os.environ if environ is None else environ)
    _merge(values, from_env)
    _merge(values, overrides or {})
    # where a value that is still in force came from, for the error that refuses it
    flagged = {(s, k) for s, t in (overrides or {}).items() for k, v in t.items() if v is not None}
    env_names = {(s, k): f"{env_prefix(deployable)}{s}_{k}".upper()
                 for s, t in from_env.items() for k in t if (s, k) not in flagged}
    kwargs = {}
    for section, section_cls in sections.items():
        fields = {f.name: f for f in dataclasses.fields(section_cls)}
        given = values.get(section, {})
        unknown = set(given) - set(fields)
        if unknown:
            raise ConfigError(f"unknown key(s) in [{section}]: {', '.join(sorted(unknown))}")
        hints = typing.get_type_hints(section_cls)
        coerced = {k: _coerce(v, hints[k], _where(section, k, env_names)) for k, v in given.items()}
        try:
            kwargs[section] = section_cls(**coerced)
        except (TypeError, ValueError) as e:
            # a section's check names its key in words: then name the variable that set that key, if one did
            named = [(k, name) for (s, k), name in env_names.items()
                     if s == section and re.search(rf"\b{re.escape(k)}\b", str(e))]
            if named:
                key, name = named[0]
                raise ConfigError(f"{name}={given[key]}: [{section}] {e}") from e
            raise ConfigError(f"[{section}]: {e}") from e
    return cls(**kwargs)


def env_prefix(deployable: str) -> str:
    return f"CASCADE_{deployable.upper()}_"


def _where(section: str, key: str, env_names: dict[tuple[str, str], str]) -> str:
    """How an error names a value: its environment variable when one set it."""
    name = env_names.get((section, key))
    return f"{name} ({section}.{key})" if name else f"{section}.{key}"


def _section_types(cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _from_environ(sections: dict[str, type], deployable: str, environ) -> dict[str, dict[str, Any]]:
    prefix = env_prefix(deployable)
    out: dict[str, dict[str, Any]] = {}
    for name, raw in environ.items():
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix):].lower()
        section = next((s for s in sections if rest.startswith(s + "_")), None)
        if section is None:
            log.warning("ignoring %s: there is no [%s] section (sections: %s)", name, rest.partition("_")[0],
                        ", ".join(sections))
            continue
        key = rest[len(section) + 1:]
        keys = [f.name for f in dataclasses.fields(sections[section])]
        if key in keys:
            out.setdefault(section, {})[key] = raw
        else:  # a typo would otherwise be silently ignored
            log.warning("ignoring %s: [%s] has no key %r (keys: %s)", name, section, key, ", ".join(keys))
    return out


def _merge(into: dict[str, dict[str, Any]], other: dict[str, dict[str, Any]]) -> None:
    for section, table in other.items():
        into.setdefault(section, {}).update({k: v for k, v in table.items() if v is not None})


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Turn a TOML or environment value into the field's declared type."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
            return None
        return _coerce(value, args[0], where)
    if origin is list:
        (item,) = typing.get_args(hint)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        return [_coerce(v, item, where) for v in value]
    try:
        if hint is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in _TRUE:
                return True
            if str(value).lower() in _FALSE:
                return False
            raise ValueError(value)
        if hint is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if hint is float:
            return float(value)
        if hint is str:
            return str(value)
        if hint is Path:
            return Path(value).expanduser()
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: expected {hint.__name__}, got {value!r}") from e
    return value


def write_section(path: Path, section_name: str, updates: dict) -> None:
    """Set ``updates`` in the ``[section_name]`` table of the TOML file at ``path`` (created if
    missing), keeping everything else in it."""
    import tomli_w

    data = tomllib.loads(path.read_text()) if path.is_file() else {}
    section = data.setdefault(section_name, {})
    section.update(updates)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(data))


def check_range(section: object, bounds: dict[str, tuple[float, float]]) -> None:
    """Each named number of ``section`` is finite and within its ``(low, high)`` bounds; a
    ValueError naming the key otherwise (the loader names the variable that set it)."""
    for key, (low, high) in bounds.items():
        value = getattr(section, key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
                (isinstance(value, int) or math.isfinite(value)) and low <= value <= high):
            raise ValueError(f"{key} must be a finite number in {_num(low)}..{_num(high)}, got {value!r}")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
