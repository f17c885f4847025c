"""How the listings print: columns and times."""

from __future__ import annotations

import datetime
import json


def print_table(rows: list[tuple[str, ...]]) -> None:
    """Rows (the first is the header) in columns two spaces apart, the last column unpadded."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join([c.ljust(w) for c, w in zip(r, widths, strict=False)] + [r[-1]]).rstrip())


def utc_time(ts: float, fmt: str = "%Y-%m-%d %H:%M:%SZ") -> str:
    """A Unix time as the listings show it (UTC)."""
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime(fmt)


def printed_whole(items: list, as_json: bool, none: str) -> bool:
    """A listing's two cases with nothing to tabulate: ``items`` as JSON, or the line saying there are
    none (``none``). True when one of them was printed, so the caller has no table to print."""
    if as_json:
        print(json.dumps(items, indent=2))
        return True
    if not items:
        print(none)
        return True
    return False
