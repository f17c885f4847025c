"""``cascade cloud keys``: create, list and revoke the gateway's API keys."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def _store(args):
    from cascade.config import cascade_home
    from cloud_tier.gateway.keys import KeyStore

    # the same file the gateway opens: --db, else [gateway] db from the environment, else the default
    default = os.environ.get("CASCADE_CLOUD_GATEWAY_DB") or cascade_home() / "cloud" / "gateway.db"
    path = Path(args.db) if args.db else Path(default)
    path.parent.mkdir(parents=True, exist_ok=True)
    return KeyStore(path)


def _limit(value: float) -> str:
    return f"{value:g}" if value else "none"


def cmd_keys_create(args) -> int:
    from cloud_tier.gateway.keys import TenantLimits

    scopes = ("infer", "admin") if args.admin else ("infer",)
    store = _store(args)
    try:
        # checked before anything is written, so a bad flag leaves the database as it was
        TenantLimits(args.tenant, args.tenant_rps or 0.0, args.tenant_tpm or 0.0)
        plaintext, key = store.create(args.tenant, device=args.device, scopes=scopes,
                                      rps=args.rps, tpm=args.tpm, priority=args.priority)
        limits = store.set_tenant_limits(args.tenant, rps=args.tenant_rps, tpm=args.tenant_tpm)
    except ValueError as e:
        print(f"cascade: {e}", file=sys.stderr)
        return 2
    finally:
        store.close()
    print(f"key {key.key_id}: tenant {key.tenant}, device {key.device or '-'}, "
          f"scopes {','.join(sorted(key.scopes))}, priority {key.priority}")
    print(f"  key limits: rps {_limit(key.rps)}, tpm {_limit(key.tpm)}; "
          f"tenant limits: rps {_limit(limits.rps)}, tpm {_limit(limits.tpm)}")
    print("  the key is shown once, on the next line:")
    print(plaintext)
    return 0


def cmd_keys_list(args) -> int:
    store = _store(args)
    try:
        keys = store.list(args.tenant)
    finally:
        store.close()
    if args.json:
        print(json.dumps([{"key_id": k.key_id, "tenant": k.tenant, "device": k.device,
                           "scopes": sorted(k.scopes), "rps": k.rps, "tpm": k.tpm, "priority": k.priority,
                           "created_at": k.created_at, "revoked": k.revoked} for k in keys],
                         indent=2))
        return 0
    if not keys:
        print("no keys")
        return 0
    rows = [("KEY ID", "TENANT", "DEVICE", "SCOPES", "RPS", "TPM", "PRIORITY", "CREATED", "REVOKED")]
    for k in keys:
        created = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(k.created_at))
        rows.append((k.key_id, k.tenant, k.device or "-", ",".join(sorted(k.scopes)),
                     _limit(k.rps), _limit(k.tpm), str(k.priority), created, "yes" if k.revoked else "no"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return 0


def cmd_keys_revoke(args) -> int:
    store = _store(args)
    try:
        found = store.revoke(args.key_id)
    finally:
        store.close()
    if not found:
        print(f"cascade: no key with id {args.key_id}", file=sys.stderr)
        return 1
    print(f"revoked {args.key_id}")
    return 0


def add_keys_parser(subparsers) -> None:
    """Add ``keys create|list|revoke`` to the ``cascade cloud`` subcommands."""
    from cascade.cli_help import DefaultsHelp as help_format

    keys = subparsers.add_parser("keys", help="the gateway's API keys (works while the gateway runs)").add_subparsers(
        dest="keys_command", required=True, metavar="COMMAND")
    db_help = "the gateway database (default: $CASCADE_HOME/cloud/gateway.db)"

    create = keys.add_parser("create", help="a new key for a tenant; prints it once, last",
                             description="A new key for a tenant; prints it once, alone on the last line.",
                             formatter_class=help_format)
    create.add_argument("--tenant", required=True, help="the tenant the key belongs to (quotas, cache, billing)")
    create.add_argument("--device", help="bind the key to this device (a device key is never admin)")
    create.add_argument("--rps", type=float, default=0.0, help="this key's requests/s (0: none)")
    create.add_argument("--tpm", type=float, default=0.0, help="this key's tokens/min (0: none)")
    create.add_argument("--priority", type=int, default=0,
                        help="the engine priority of this key's requests (lower is served first and preempts "
                             "later ones; a request may only ask for a later one, a larger number)")
    create.add_argument("--admin", action="store_true", help="add the admin scope")
    create.add_argument("--tenant-rps", type=float, help="set the tenant's requests/s, over all its keys (0: none)")
    create.add_argument("--tenant-tpm", type=float, help="set the tenant's tokens/min, over all its keys (0: none)")
    create.add_argument("--db", help=db_help)
    create.set_defaults(func=cmd_keys_create)

    ls = keys.add_parser("list", help="the keys (never the keys themselves)", formatter_class=help_format)
    ls.add_argument("--tenant", help="only this tenant's keys")
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.add_argument("--db", help=db_help)
    ls.set_defaults(func=cmd_keys_list)

    revoke = keys.add_parser("revoke", help="revoke a key by its id (exit 1: no such key)",
                             formatter_class=help_format)
    revoke.add_argument("key_id", help="the id `cascade cloud keys list` shows")
    revoke.add_argument("--db", help=db_help)
    revoke.set_defaults(func=cmd_keys_revoke)
