"""Activation windows: when a device may switch to a version it has downloaded and verified.

A window is device local time, either ``HH:MM-HH:MM`` (it may run past midnight; ``00:00-24:00``
is always open) or a five-field cron expression (``* 2-4 * * 1-5``: the minutes it matches). The
control plane checks a rollout's window with ``parse_window`` before it starts it; a device checks
the window of each document again (one from an older control plane may hold a window that never
opens) and refuses it with the reason instead of waiting for it forever.
"""

from __future__ import annotations

import datetime
import re

from croniter import croniter

# A cron window must open at least once in any DAYS_TO_OPEN days. Checked from a fixed day just after
# a 29 February rather than from now, so a window is accepted or refused the same way whenever it is
# checked (a stored rollout's spec is checked again each time it is read): an expression that matches
# every year passes, one that matches only on a 29 February (or a fifth Monday of February) does not.
DAYS_TO_OPEN = 400
_REFERENCE = datetime.datetime(2025, 3, 1)
_CRON_SEARCH_YEARS = 9  # croniter gives up after this many years without a match (a leap day is found)
_HHMM = re.compile(r"\s*(\d{1,2}):(\d{2})\s*-\s*(\d{1,2}):(\d{2})\s*")


def parse_window(text: str) -> tuple[int, int] | str:
    """An activation window: "02:00-05:00" -> (120, 300) minutes of the day; a five-field cron
    expression -> itself. ValueError, saying why, for anything else and for a window that never
    opens: the same start and end time, or a cron expression with no match in DAYS_TO_OPEN days
    (31 February) or one croniter cannot work with."""
    if not isinstance(text, str):
        raise ValueError(f"window {text!r} must be a string: HH:MM-HH:MM or a five-field cron expression")
    m = _HHMM.fullmatch(text)
    if m is None:
        return _cron(text)
    h1, m1, h2, m2 = map(int, m.groups())
    start, end = h1 * 60 + m1, h2 * 60 + m2
    if h1 > 23 or m1 > 59 or m2 > 59 or end > 24 * 60:
        raise ValueError(f"window {text!r} must be HH:MM-HH:MM, from 00:00-23:59 to 00:00-24:00")
    if start == end:
        raise ValueError(f"window {text!r} never opens: it starts and ends at the same time "
                         "(00:00-24:00 is always open)")
    return start, end


def _cron(text: str) -> str:
    expr = text.strip()
    if len(expr.split()) != 5 or not croniter.is_valid(expr):
        raise ValueError(f"window {text!r} must be HH:MM-HH:MM or a five-field cron expression "
                         "(minute hour day month weekday, e.g. '* 2-4 * * *')")
    try:
        opens = croniter(expr, _REFERENCE, max_years_between_matches=_CRON_SEARCH_YEARS).get_next(datetime.datetime)
    except Exception as e:  # croniter's CroniterBadDateError (no such date), or anything else it cannot do
        raise ValueError(f"window {text!r} never opens: cron finds no date it matches in {_CRON_SEARCH_YEARS} "
                         f"years ({e})") from None
    if opens - _REFERENCE > datetime.timedelta(days=DAYS_TO_OPEN):
        raise ValueError(f"window {text!r} opens less than once in {DAYS_TO_OPEN} days: a rollout would wait "
                         f"years for it")
    return expr


def in_window(text: str, now: datetime.datetime | None = None) -> bool:
    """Is local time ``now`` inside the window (a cron window: does it match this minute)? Total: a
    window ``parse_window`` refuses is treated as open (a device never blocks on one; it refuses
    such a window before it asks)."""
    try:
        window = parse_window(text)
        now = now or datetime.datetime.now()
        if isinstance(window, str):
            return croniter.match(window, now.replace(second=0, microsecond=0))
    except Exception:
        return True
    start, end = window
    minute = now.hour * 60 + now.minute
    return start <= minute < end if start <= end else minute >= start or minute < end


def seconds_to_window(text: str, now: datetime.datetime | None = None) -> float:
    """Seconds from ``now`` (local time) until the window next opens: 0 inside it, and for a window
    ``parse_window`` refuses (see ``in_window``); otherwise finite, under DAYS_TO_OPEN days."""
    now = now or datetime.datetime.now()
    if in_window(text, now):
        return 0.0
    window = parse_window(text)  # in_window returned False: a window it accepts
    if isinstance(window, str):
        try:
            opens = croniter(window, now, max_years_between_matches=_CRON_SEARCH_YEARS).get_next(datetime.datetime)
        except Exception:
            return 0.0
        return max(0.0, (opens - now).total_seconds())
    opens = now.replace(hour=window[0] // 60, minute=window[0] % 60, second=0, microsecond=0)
    if opens <= now:
        opens += datetime.timedelta(days=1)
    return (opens - now).total_seconds()
