"""``cascade edge queue``: the device's offline queue from the shell (works whether the agent runs
or not: the queue is a WAL-mode SQLite file both may open).

    cascade edge queue [status]          backlog: counts by state and kind, oldest age, bytes
    cascade edge queue list              items, oldest first (--state, --kind, --limit)
    cascade edge queue retry [ID ...]    queue failed/expired items again (--state)
    cascade edge queue drop [ID ...]     delete items (--state, --kind)
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from cascade_cli.parsing import DefaultsHelp, int_in
from sync.queue_view import MAX_LIST


def _error(it) -> str:
    """What an item waits on or failed of; nothing for one delivered (an old error is over)."""
    return "" if it.state == "done" else it.last_error


def _queue(args):
    from cascade.config import ConfigError
    from edge_agent.config import EdgeConfig, default_config_path
    from edge_agent.server.outbox import open_queue, queue_path

    try:
        config = EdgeConfig.load(args.config or default_config_path())
    except ConfigError as e:  # a bad config is exit 2, as for the agent
        print(f"cascade: {e}", file=sys.stderr)
        raise SystemExit(2) from e
    if args.db:
        config.sync.path = args.db
    path = queue_path(config.sync)
    if not path.exists() and args.queue_command != "status":
        raise SystemExit(f"cascade: no offline queue at {path}")
    return open_queue(config.sync), path


def cmd_status(args) -> int:
    from cascade.units import format_size as _size

    q, path = _queue(args)
    s = q.stats()
    if args.json:
        print(json.dumps({"path": str(path), **s}, indent=2))
        return 0
    states = ("queued", "sending", "done", "failed", "expired")
    print(f"offline queue {path}")
    print(f"{'kind':<10}" + "".join(f"{st:>9}" for st in states))
    for kind, counts in s["by_kind"].items():
        print(f"{kind:<10}" + "".join(f"{counts.get(st, 0):>9}" for st in states))
    age = s["oldest_pending_age_s"]
    print(f"pending: {s['pending_items']} items, {_size(s['pending_bytes'])} "
          f"(bounds {s['max_items']} items, {_size(s['max_bytes'])}); oldest pending: "
          f"{'-' if age is None else f'{age:.1f} s'}; stored: {_size(s['bytes'])}; "
          f"telemetry dropped: {s['telemetry_dropped']}")
    return 0


def cmd_list(args) -> int:
    q, _ = _queue(args)
    items = q.items(args.state, args.kind, args.limit)
    if args.json:
        print(json.dumps([{"id": it.id, "kind": it.kind, "state": it.state, "session": it.session,
                           "priority": it.priority, "attempts": it.attempts, "created_at": it.created_at,
                           "failures": it.failures, "last_error": _error(it) or None} for it in items], indent=2))
        return 0
    now = time.time()
    print(f"{'id':<38}{'kind':<11}{'state':<9}{'age':>9}{'tries':>6}  session / last error")
    for it in items:
        print(f"{it.id:<38}{it.kind:<11}{it.state:<9}{now - it.created_at:>8.1f}s{it.attempts:>6}  "
              f"{it.session or '-'} {_error(it)[:60]}")
    return 0


def _change(args, verb: str, change) -> int:
    try:
        n = change()
    except ValueError as e:
        print(f"cascade: {e}", file=sys.stderr)
        return 2
    print(f"{n} item(s) {verb}")
    return 0 if n or not args.ids else 1  # named items that are not there: exit 1


def cmd_retry(args) -> int:
    q, _ = _queue(args)
    return _change(args, "queued again", lambda: q.retry(args.ids, args.state))  # no state: failed and expired


def cmd_drop(args) -> int:
    q, _ = _queue(args)
    return _change(args, "dropped", lambda: q.drop(args.ids, args.state, args.kind))


def add_queue_parser(edge_subparsers) -> None:
    """Add ``queue status|list|retry|drop`` to the ``cascade edge`` subcommands."""
    states = ["queued", "sending", "done", "failed", "expired"]

    queue = edge_subparsers.add_parser("queue", help="the offline queue: backlog, retry, drop (works while the "
                                       "agent runs)", formatter_class=DefaultsHelp)
    queue.set_defaults(func=cmd_status, queue_command="status", json=False)
    common = {"--config": "edge.toml (its [sync] path; CASCADE_EDGE_SYNC_PATH too; default: $CASCADE_HOME/edge.toml "
                          "if it exists, as the agent)",
              "--db": "the queue file (default: [sync] path, else $CASCADE_HOME/edge/queue.db)"}
    for flag, help_ in common.items():
        queue.add_argument(flag, help=help_)
    sub = queue.add_subparsers(dest="queue_command")

    def command(name: str, help_: str, func):
        p = sub.add_parser(name, help=help_, description=help_, formatter_class=DefaultsHelp)
        for flag, h in common.items():
            p.add_argument(flag, help=h, default=argparse.SUPPRESS)  # given before or after the verb
        p.set_defaults(func=func)
        return p

    status = command("status", "counts by state and kind, oldest pending age, bytes", cmd_status)
    status.add_argument("--json", action="store_true", help="print JSON")
    ls = command("list", "items, oldest first", cmd_list)
    ls.add_argument("--state", choices=states, help="only items in this state")
    ls.add_argument("--kind", choices=["request", "telemetry"], help="only items of this kind")
    ls.add_argument("--limit", type=int_in(1, MAX_LIST), default=50, help=f"items at most (1..{MAX_LIST})")
    ls.add_argument("--json", action="store_true", help="print JSON")
    retry = command("retry", "queue failed or expired items again (all of them unless named)", cmd_retry)
    retry.add_argument("ids", nargs="*", help="item ids (none: every failed and expired item)")
    retry.add_argument("--state", choices=["failed", "expired"], help="only items in this state")
    drop = command("drop", "delete items, results included", cmd_drop)
    drop.add_argument("ids", nargs="*", help="item ids")
    drop.add_argument("--state", choices=states, help="every item in this state")
    drop.add_argument("--kind", choices=["request", "telemetry"], help="every item of this kind")

