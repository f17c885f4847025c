"""``cascade cloud keys``: create, list and revoke the gateway's API keys, set budgets and tenants'
limits (rates and the floors on the service-level targets their requests may ask). ``--db``
is the gateway's key store (a SQLite path or a postgresql:// DSN), ``--redis`` where its spend is
counted (for the spend shown)."""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
from contextlib import contextmanager

from cascade_cli.parsing import DefaultsHelp
from cascade_cli.tables import print_table


class _Refused(Exception):
    """A bad command line: one line on stderr, exit 2."""


@contextmanager
def _opened(args):
    """The key store the gateway opens (--db, else [gateway] db from the environment, else the
    default file) and its budgets, spend read where the gateway counts it (--redis, likewise)."""
    from cloud_tier.gateway.pipeline.stores import open_key_store, open_spend
    from cloud_tier.gateway.tenants.budgets import Budgets

    try:
        store = open_key_store(args.db or os.environ.get("CASCADE_CLOUD_GATEWAY_DB", ""))
    except (OSError, sqlite3.Error) as e:
        raise _Refused(str(e)) from e
    spend = store
    try:
        spend = open_spend(store, args.redis or os.environ.get("CASCADE_CLOUD_GATEWAY_REDIS", ""))
        yield store, Budgets(store, spend, {})
    finally:
        if spend is not store:
            spend.close()
        store.close()


def _limit(value: float) -> str:
    return f"{value:g}" if value else "none"


def _budget_text(b) -> str:
    caps = [f"{b.tokens:g} tokens" if b.tokens else "", f"${b.usd:g}" if b.usd else ""]
    return f"{' + '.join(c for c in caps if c)}/{b.period}" if b.active else "none"


def _spent_text(s) -> str:
    return f"{s.tokens:g} tokens ${s.usd:.4g}"


def _spend_json(s) -> dict:
    from cloud_tier.gateway.tenants.budgets import iso_utc

    return {"budget": {"tokens": s.budget.tokens, "usd": s.budget.usd, "period": s.budget.period},
            "spent": {"tokens": s.tokens, "usd": s.usd, "period": s.period_id, "resets_at": iso_utc(s.resets_at)}}


def _run(command, args) -> int:
    try:
        return command(args)
    except (_Refused, ValueError) as e:
        print(f"cascade: {e}", file=sys.stderr)
        return 2


def cmd_keys_create(args) -> int:
    from cloud_tier.gateway.tenants.keys import Budget, TenantLimits

    scopes = ("infer", "admin") if args.admin else ("infer",)
    # checked before anything is written, so a bad flag leaves the database as it was
    TenantLimits(args.tenant, args.tenant_rps or 0.0, args.tenant_tpm or 0.0)
    key_budget = (args.budget_tokens, args.budget_usd, args.budget_period)
    tenant_budget = (args.tenant_budget_tokens, args.tenant_budget_usd)
    Budget(args.budget_tokens or 0.0, args.budget_usd or 0.0, args.budget_period or "month")
    Budget(args.tenant_budget_tokens or 0.0, args.tenant_budget_usd or 0.0)
    with _opened(args) as (store, _):
        plaintext, key = store.create(args.tenant, device=args.device, scopes=scopes,
                                      rps=args.rps, tpm=args.tpm, priority=args.priority)
        limits = store.set_tenant_limits(args.tenant, rps=args.tenant_rps, tpm=args.tenant_tpm)
        if any(v is not None for v in key_budget):
            store.set_budget("key", key.key_id, *key_budget)
        if any(v is not None for v in tenant_budget):
            store.set_budget("tenant", args.tenant, *tenant_budget, args.budget_period)
        key_b, tenant_b = store.budget("key", key.key_id), store.budget("tenant", args.tenant)
    print(f"key {key.key_id}: tenant {key.tenant}, device {key.device or '-'}, "
          f"scopes {','.join(sorted(key.scopes))}, priority {key.priority}")
    print(f"  key limits: rps {_limit(key.rps)}, tpm {_limit(key.tpm)}, budget {_budget_text(key_b)}; "
          f"tenant limits: rps {_limit(limits.rps)}, tpm {_limit(limits.tpm)}, budget {_budget_text(tenant_b)}")
    print(f"  revoke it with: cascade cloud keys revoke {key.key_id}; the key is shown once, on the next line:")
    print(plaintext)
    return 0


def cmd_keys_list(args) -> int:
    with _opened(args) as (store, budgets):
        keys = store.list(args.tenant)
        spend = {k.key_id: budgets.status(k.tenant, k.key_id) for k in keys}  # [tenant's, key's]
    if args.json:
        print(json.dumps([{"key_id": k.key_id, "tenant": k.tenant, "device": k.device,
                           "scopes": sorted(k.scopes), "rps": k.rps, "tpm": k.tpm, "priority": k.priority,
                           "created_at": k.created_at, "revoked": k.revoked, **_spend_json(spend[k.key_id][1]),
                           "tenant_budget": _spend_json(spend[k.key_id][0])["budget"],
                           "tenant_spent": _spend_json(spend[k.key_id][0])["spent"]} for k in keys], indent=2))
        return 0
    if not keys:
        print("no keys")
        return 0
    rows = [("KEY ID", "TENANT", "DEVICE", "SCOPES", "RPS", "TPM", "PRIORITY", "BUDGET", "SPENT", "CREATED",
             "REVOKED")]
    tenants = {}
    for k in keys:
        created = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(k.created_at))
        tenant_spend, key_spend = spend[k.key_id]
        tenants[k.tenant] = tenant_spend
        rows.append((k.key_id, k.tenant, k.device or "-", ",".join(sorted(k.scopes)), _limit(k.rps), _limit(k.tpm),
                     str(k.priority), _budget_text(key_spend.budget), _spent_text(key_spend), created,
                     "yes" if k.revoked else "no"))
    print_table(rows)
    print()
    from cloud_tier.gateway.tenants.budgets import iso_utc

    print_table([("TENANT", "BUDGET", "SPENT", "PERIOD", "RESETS")] + [
        (t, _budget_text(s.budget), _spent_text(s), s.period_id, iso_utc(s.resets_at)) for t, s in tenants.items()])
    return 0


def cmd_keys_revoke(args) -> int:
    with _opened(args) as (store, _):
        found = store.revoke(args.key_id)
    if not found:
        print(f"cascade: no key with id {args.key_id}", file=sys.stderr)
        return 1
    print(f"revoked {args.key_id}")
    return 0


def cmd_keys_budget(args) -> int:
    from cloud_tier.gateway.tenants.budgets import iso_utc
    from cloud_tier.gateway.tenants.keys import Budget

    Budget(args.tokens or 0.0, args.usd or 0.0, args.period or "month")  # before anything is written
    scope, name = ("key", args.key) if args.key else ("tenant", args.tenant)
    with _opened(args) as (store, budgets):
        if args.key and args.key not in {k.key_id for k in store.list(args.tenant)}:
            print(f"cascade: no key with id {args.key} in tenant {args.tenant}", file=sys.stderr)
            return 1
        if (args.tokens, args.usd, args.period) != (None, None, None):
            store.set_budget(scope, name, args.tokens, args.usd, args.period)
        status = budgets.status(args.tenant, args.key)[-1]
    print(f"{scope} {name}: budget {_budget_text(status.budget)}; spent {_spent_text(status)} in {status.period_id}, "
          f"resets at {iso_utc(status.resets_at)}")
    return 0


def _limits_text(limits) -> str:
    floor = lambda v: f"{v:g} s" if v else "the gateway's"  # noqa: E731
    return (f"tenant {limits.tenant}: rps {_limit(limits.rps)}, tpm {_limit(limits.tpm)}, min ttft_slo_s "
            f"{floor(limits.min_ttft_slo_s)}, min tpot_slo_s {floor(limits.min_tpot_slo_s)}")


def cmd_keys_limits(args) -> int:
    from cloud_tier.gateway.tenants.keys import TenantLimits

    given = (args.rps, args.tpm, args.min_ttft_slo_s, args.min_tpot_slo_s)
    TenantLimits(args.tenant, *(v or 0.0 for v in given))  # checked before anything is written
    with _opened(args) as (store, _):
        limits = (store.set_tenant_limits(args.tenant, *given) if any(v is not None for v in given)
                  else store.tenant_limits(args.tenant))
    print(_limits_text(limits))
    return 0


COMMANDS = ("create", "list", "revoke", "budget", "limits")


def add_keys_parser(subparsers) -> None:
    """Add ``keys create|list|revoke|budget|limits`` to the ``cascade cloud`` subcommands."""
    about = "the gateway's API keys: create, list, revoke; budgets and tenants' limits (works while the gateway runs)"
    keys = subparsers.add_parser(
        "keys", help=about, description=about,
        epilog="e.g. cascade cloud keys create --tenant acme; cascade cloud keys revoke KEY_ID; "
               "cascade cloud keys limits acme --min-tpot-slo-s 0.05").add_subparsers(
        dest="keys_command", required=True, metavar="{" + ",".join(COMMANDS) + "}")

    def add(name: str, func, **kwargs):
        p = keys.add_parser(name, formatter_class=DefaultsHelp, **kwargs)
        p.add_argument("--db", help="the gateway's key store: a SQLite path or a postgresql:// DSN (default: "
                                    "$CASCADE_CLOUD_GATEWAY_DB, else $CASCADE_HOME/cloud/gateway.db)")
        p.add_argument("--redis", help="the gateway's Redis, where spend is counted when it has one (default: "
                                       "$CASCADE_CLOUD_GATEWAY_REDIS; none: spend is in --db)")
        p.set_defaults(func=lambda args: _run(func, args))
        return p

    create = add("create", cmd_keys_create, help="a new key for a tenant; prints it once, last",
                 description="A new key for a tenant; prints it once, alone on the last line.")
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
    create.add_argument("--budget-tokens", type=float, help="this key's token budget per period (0: none)")
    create.add_argument("--budget-usd", type=float, help="this key's USD budget per period, priced by [gateway] "
                                                         "model_prices (0: none)")
    create.add_argument("--budget-period", choices=["day", "month"],
                        help="the budgets' period, UTC calendar days or months (default: month)")
    create.add_argument("--tenant-budget-tokens", type=float, help="set the tenant's token budget per period, "
                                                                   "over all its keys (0: none)")
    create.add_argument("--tenant-budget-usd", type=float, help="set the tenant's USD budget per period (0: none)")

    ls = add("list", cmd_keys_list, help="the keys (never the keys themselves), budgets and this period's spend")
    ls.add_argument("--tenant", help="only this tenant's keys")
    ls.add_argument("--json", action="store_true", help="print JSON")

    revoke = add("revoke", cmd_keys_revoke, help="revoke a key by its id (exit 1: no such key)")
    revoke.add_argument("key_id", help="the id `cascade cloud keys list` shows")

    budget = add("budget", cmd_keys_budget, help="set or show the budget of a tenant or of one of its keys "
                                                 "(exit 1: no such key)")
    budget.add_argument("--tenant", required=True, help="the tenant")
    budget.add_argument("--key", help="the key id (default: the tenant's own budget, over all its keys)")
    budget.add_argument("--tokens", type=float, help="tokens per period (0: none)")
    budget.add_argument("--usd", type=float, help="USD per period, priced by [gateway] model_prices (0: none)")
    budget.add_argument("--period", choices=["day", "month"], help="UTC calendar days or months (default: as set, "
                                                                   "else month)")

    limits = add("limits", cmd_keys_limits, help="set or show a tenant's limits: its rates over all its keys and "
                                                 "the tightest service-level targets its requests may ask")
    limits.add_argument("tenant", help="the tenant")
    limits.add_argument("--rps", type=float, help="requests/s over all its keys (0: none)")
    limits.add_argument("--tpm", type=float, help="tokens/min over all its keys (0: none)")
    limits.add_argument("--min-ttft-slo-s", type=float, metavar="S",
                        help="the tightest ttft_slo_s its requests may ask, a 400 below (0: [gateway] min_ttft_slo_s)")
    limits.add_argument("--min-tpot-slo-s", type=float, metavar="S",
                        help="the tightest tpot_slo_s its requests may ask, a 400 below (0: [gateway] min_tpot_slo_s); "
                             "the workers serve none tighter than [engine] min_tpot_slo_s / tpot_min_batch allow")
