"""Session order: an escalation whose session still has requests waiting for the cloud goes
behind them (queued, answered 202), so the cloud sees a session's requests in the order the app
sent them, even once it is reachable again. It applies to requests whose offline policy is
``queue``: a request that may be answered locally or refused does not wait for a backlog."""

from __future__ import annotations


def goes_behind_backlog(session_backlog: bool, offline: str) -> bool:
    """``session_backlog``: the request's session has requests queued or being delivered."""
    return session_backlog and offline == "queue"
