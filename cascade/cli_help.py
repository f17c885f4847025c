"""How every ``cascade`` subcommand's ``--help`` reads: each flag with its default."""

from __future__ import annotations

import argparse
import datetime


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where there is none to show (``None``, off switches) or
    the help already names it (flags whose value comes from the config say so themselves)."""

    def _get_help_string(self, action):
        if action.default in (None, False, argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def print_table(rows: list[tuple[str, ...]]) -> None:
    """Rows (the first is the header) in columns two spaces apart, the last column unpadded."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join([c.ljust(w) for c, w in zip(r, widths, strict=False)] + [r[-1]]).rstrip())


def utc_time(ts: float, fmt: str = "%Y-%m-%d %H:%M:%SZ") -> str:
    """A Unix time as the listings show it (UTC)."""
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime(fmt)
