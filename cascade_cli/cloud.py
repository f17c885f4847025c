"""``cascade cloud``: one engine worker (``worker``), the gateway with the workers it starts
(``serve``), and the gateway's API keys (``keys``, keys.py)."""

from __future__ import annotations

import argparse
import sys

from cascade_cli.parsing import add_command


def cmd_cloud_worker(args) -> int:
    from cascade.config import ConfigError
    from cloud_tier.config import CloudConfig
    from cloud_tier.worker import daemon
    from model_distribution.artifacts.catalog import ModelNotFound

    overrides = {
        "server": {"host": args.host, "port": args.port, "api_key": args.api_key},
        "engine": {"model": args.model, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
                   "weight_dtype": args.weight_dtype, "device": args.device,
                   "kv_cache_memory_bytes": args.kv_cache_bytes,
                   "max_model_len": args.max_model_len,
                   "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                   "threads": args.threads, "ttft_slo_s": args.ttft_slo_s, "tpot_slo_s": args.tpot_slo_s,
                   "slo_headroom": args.slo_headroom, "reservations": args.reservations,
                   "tpot_min_batch": args.tpot_min_batch, "min_tpot_slo_s": args.min_tpot_slo_s,
                   **_speculative(args)},
        "worker": {"role": args.role},
    }
    try:
        daemon.run(CloudConfig.load(args.config, overrides))
    except (ConfigError, ModelNotFound, NotImplementedError) as e:
        print(f"cascade: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_cloud_serve(args) -> int:
    from cascade.config import ConfigError
    from cloud_tier import serve
    from cloud_tier.config import CloudConfig
    from cloud_tier.worker.processes import StartupError
    from model_distribution.artifacts.catalog import ModelNotFound

    # --prefill/--decode: a number of workers to start here, or the URLs of vLLM prefill/decode workers
    prefill_urls = decode_urls = None
    for role in ("prefill", "decode"):
        value = getattr(args, role)
        if value is not None and not value.strip().isdigit():
            urls = [u.strip() for u in value.split(",") if u.strip()]
            if not urls or not all(u.startswith(("http://", "https://")) for u in urls):
                print(f"cascade: --{role} takes a number of workers to start or http(s):// URLs, not {value!r}",
                      file=sys.stderr)
                return 2
            prefill_urls, decode_urls = (",".join(urls), decode_urls) if role == "prefill" else (prefill_urls,
                                                                                                 ",".join(urls))
            setattr(args, role, None)
        elif value is not None:
            setattr(args, role, int(value))
    if (prefill_urls is None) != (decode_urls is None):
        print("cascade: prefill/decode pairs need both --prefill URL and --decode URL", file=sys.stderr)
        return 2
    if args.both and args.prefill is None and args.decode is None:
        args.prefill = args.decode = 0  # `--both N` alone: N co-located workers, nothing else
    overrides = {
        "gateway": {"host": args.host, "port": args.port, "db": args.db, "redis": args.redis,
                    "prefill": args.prefill, "decode": args.decode,
                    "both": args.both, "workers": args.workers, "worker_threads": args.worker_threads,
                    "kv_transport": args.kv_transport, "worker_type": args.worker_type,
                    "prefill_workers": prefill_urls, "decode_workers": decode_urls,
                    "kv_connector": args.kv_connector, "class_slos": args.class_slos,
                    "min_ttft_slo_s": args.request_min_ttft_slo_s, "min_tpot_slo_s": args.request_min_tpot_slo_s},
        "server": {"api_key": args.worker_api_key},
        "engine": {"model": args.model, "dtype": args.dtype, "max_model_len": args.max_model_len,
                   "kv_cache_dtype": args.kv_cache_dtype, "weight_dtype": args.weight_dtype,
                   "kv_cache_memory_bytes": args.kv_cache_bytes,
                   "ttft_slo_s": args.ttft_slo_s, "tpot_slo_s": args.tpot_slo_s, "slo_headroom": args.slo_headroom,
                   "reservations": args.reservations, "tpot_min_batch": args.tpot_min_batch,
                   "min_tpot_slo_s": args.min_tpot_slo_s, **_speculative(args)},
    }
    overrides["gateway"].update(k8s_namespace=args.k8s_namespace, k8s_selector=args.k8s_selector,
                                k8s_prefill_selector=args.k8s_prefill_selector,
                                k8s_decode_selector=args.k8s_decode_selector, k8s_port=args.k8s_port)
    try:
        serve.run(CloudConfig.load(args.config, overrides))
    except (ConfigError, ModelNotFound, StartupError) as e:
        print(f"cascade: {e}", file=sys.stderr)
        return 2
    return 0



def _add_service_levels(p: argparse.ArgumentParser, lead: str = "") -> None:
    """The engine's service-level flags (a worker's, or those `cloud serve` gives the workers it starts)."""
    from cloud_tier.engine_config import EngineConfig

    p.add_argument("--ttft-slo-s", type=float, metavar="S",
                   help=f"{lead}time-to-first-token target of requests that name none; what would miss it gets "
                        "429 + Retry-After (reason slo) (default: none)")
    p.add_argument("--tpot-slo-s", type=float, metavar="S",
                   help=f"{lead}time-per-output-token target of requests that name none: admission keeps the "
                        "running decodes within it (default: none)")
    p.add_argument("--slo-headroom", type=float, metavar="F",
                   help=f"{lead}admission promises a first token within (1 - F) of its TTFT target, leaving the "
                        f"rest for the answer's way to the client (default: {EngineConfig().slo_headroom})")
    p.add_argument("--reservations", metavar="TENANT=SHARE,...",
                   help=f"{lead}shares of the KV blocks and running slots kept for tenants, e.g. gold=0.3 "
                        "(default: none)")
    p.add_argument("--tpot-min-batch", type=int, metavar="N",
                   help=f"{lead}a TPOT target never holds the running batch under N requests nor asks a step shorter "
                        "than N decodes take (tighter: served best-effort at that floor); one tenant's targets bound "
                        f"only its own requests' slots (default: {EngineConfig().tpot_min_batch})")
    p.add_argument("--min-tpot-slo-s", type=float, metavar="S",
                   help=f"{lead}serve no TPOT target tighter than S seconds, whatever a request asks "
                        "(default: 0, only --tpot-min-batch's floor)")


def add_cloud_parser(sub) -> None:
    """``cascade cloud worker|serve|keys``."""
    from cascade_cli.keys import add_keys_parser
    from cloud_tier.config import CloudServerConfig, GatewayConfig, WorkerConfig
    from cloud_tier.engine_config import DTYPES, EngineConfig

    cloud_srv, eng, wkr, gw = CloudServerConfig(), EngineConfig(), WorkerConfig(), GatewayConfig()
    cloud = add_command(sub, "cloud", "the cloud tier: gateway, workers, API keys").add_subparsers(
        dest="cloud_command", required=True, metavar="COMMAND")
    worker = add_command(cloud, "worker", "one engine behind an OpenAI-compatible API (and the internal API)")
    worker.add_argument("--config", help="cloud.toml (default: none)")
    worker.add_argument("--role", choices=["both", "prefill", "decode"],
                        help=f"both: prefill and decode here; prefill or decode: one half of a pair "
                             f"(default: {wkr.role})")
    worker.add_argument("--host", help=f"address to listen on (default: {cloud_srv.host})")
    worker.add_argument("--port", type=int, help=f"port to listen on (default: {cloud_srv.port})")
    worker.add_argument("--model", help=f"catalogue name, .gguf path or HF directory (default: {eng.model})")
    worker.add_argument("--dtype", choices=DTYPES, help=f"auto: bfloat16 on a CPU with native bfloat16 (AVX512_BF16, "
                        f"AMX) or CUDA, else float32 (default: {eng.dtype})")
    worker.add_argument("--kv-cache-dtype", help=f"KV cache storage: auto (the dtype) or int8 (default: "
                                                 f"{eng.kv_cache_dtype})")
    worker.add_argument("--weight-dtype", help=f"linear layers' weights: auto (the dtype) or int8 (per-channel, "
                                               f"activations in the dtype) (default: {eng.weight_dtype})")
    _speculative_flags(worker, eng, "")
    worker.add_argument("--device", help=f"cpu, cuda, cuda:1 ... (default: {eng.device})")
    worker.add_argument("--api-key", help="require 'Authorization: Bearer KEY' of callers (default: none)")
    worker.add_argument("--kv-cache-bytes", type=int,
                        help=f"memory for KV blocks (default: {eng.kv_cache_memory_bytes})")
    worker.add_argument("--max-model-len", type=int, help=f"longest prompt + output, in tokens "
                                                          f"(default: {eng.max_model_len})")
    worker.add_argument("--max-num-seqs", type=int, help=f"requests in one batch (default: {eng.max_num_seqs})")
    worker.add_argument("--max-num-batched-tokens", type=int,
                        help=f"token budget of one step (default: {eng.max_num_batched_tokens})")
    worker.add_argument("--threads", type=int, help="torch threads (default: 0 = torch's choice)")
    _add_service_levels(worker)
    worker.set_defaults(func=cmd_cloud_worker)

    serve = add_command(cloud, "serve", "the gateway, with the prefill and decode workers it starts "
                                        "(or in front of --workers started elsewhere); stop: Ctrl-C or SIGTERM")
    serve.add_argument("--config", help="cloud.toml (default: none)")
    serve.add_argument("--host", help=f"the gateway's address (default: {gw.host})")
    serve.add_argument("--port", type=int, help=f"the gateway's port (default: {gw.port})")
    serve.add_argument("--prefill", metavar="N|URL,...",
                       help=f"prefill workers to start (default: {gw.prefill}; 0 when only --both is given), or "
                            "the URLs of vLLM prefill workers (with --decode URL,... and --kv-connector nixl)")
    serve.add_argument("--decode", metavar="N|URL,...",
                       help=f"decode workers to start (default: {gw.decode}; 0 when only --both is given), or "
                            "the URLs of vLLM decode workers")
    serve.add_argument("--both", type=int, help=f"co-located workers to start (default: {gw.both})")
    serve.add_argument("--workers", help="comma-separated URLs of workers started elsewhere (ours, vLLM, SGLang or "
                                         "any OpenAI-compatible server); starts none, and needs no torch here "
                                         "(default: none)")
    serve.add_argument("--worker-type", choices=["auto", "cascade", "vllm", "sglang", "openai"],
                       help="what the --workers are; auto: detected (/internal/load: ours, else the names in their "
                            f"/metrics: vllm: or sglang:, else openai) (default: {gw.worker_type})")
    serve.add_argument("--kv-connector", choices=["nixl"],
                       help="how vLLM prefill/decode pairs move KV: nixl, vLLM's NixlConnector (prefill with "
                            "max_tokens 1, then decode with its kv_transfer_params)")
    serve.add_argument("--model", help=f"for the workers it starts: catalogue name, .gguf path or HF directory "
                                       f"(default: {eng.model})")
    serve.add_argument("--worker-threads", type=int, help="torch threads per started worker "
                                                          "(default: 0 = the cores shared out)")
    serve.add_argument("--dtype", choices=DTYPES, help=f"for the workers it starts: auto: bfloat16 on a CPU with "
                       f"native bfloat16 (AVX512_BF16, AMX) or CUDA, else float32 (default: {eng.dtype})")
    _add_service_levels(serve, "for the workers it starts: ")
    serve.add_argument("--class-slos", metavar="CLASS=TTFT:TPOT,...",
                       help="TTFT and TPOT targets (seconds) by priority class for requests that name none, e.g. "
                            "interactive=2:0.2,batch=60:1 (default: none)")
    serve.add_argument("--request-min-ttft-slo-s", type=float, metavar="S",
                       help="the tightest ttft_slo_s a request may ask (400 below), for tenants with no floor of "
                            f"their own (`cascade cloud keys limits`; 0: none) (default: {gw.min_ttft_slo_s})")
    serve.add_argument("--request-min-tpot-slo-s", type=float, metavar="S",
                       help="the tightest tpot_slo_s a request may ask (400 below), for tenants with no floor of "
                            f"their own (0: none) (default: {gw.min_tpot_slo_s})")
    serve.add_argument("--kv-transport", choices=["tcp", "shm", "auto"],
                       help=f"prefill -> decode KV transport; auto: shm on one host (default: {gw.kv_transport})")
    serve.add_argument("--max-model-len", type=int, help=f"for the workers it starts (default: {eng.max_model_len})")
    serve.add_argument("--kv-cache-dtype", help=f"for the workers it starts: auto (the dtype) or int8 "
                                                f"(default: {eng.kv_cache_dtype})")
    serve.add_argument("--weight-dtype", help=f"for the workers it starts: auto (the dtype) or int8 "
                                              f"(default: {eng.weight_dtype})")
    _speculative_flags(serve, eng, "for the workers it starts: ")
    serve.add_argument("--kv-cache-bytes", type=int, help=f"memory for KV blocks, per started worker "
                                                          f"(default: {eng.kv_cache_memory_bytes})")
    serve.add_argument("--worker-api-key", help="the bearer key between the gateway and its workers (default: none)")
    serve.add_argument("--db", help="keys, budgets and idempotency records: a SQLite path, or a postgresql:// DSN that "
                                    "several gateway replicas share (default: $CASCADE_HOME/cloud/gateway.db)")
    serve.add_argument("--redis", help="a redis:// URL for the quotas, result cache and spend counters that several "
                                       "gateway replicas share (default: none, in this process)")
    serve.add_argument("--k8s-selector", metavar="SELECTOR",
                       help="find workers through the Kubernetes API: a label selector of their pods (role: the "
                            "cascade.dev/role label, else both) (default: none)")
    serve.add_argument("--k8s-prefill-selector", metavar="SELECTOR",
                       help="a label selector of prefill worker pods (default: none)")
    serve.add_argument("--k8s-decode-selector", metavar="SELECTOR",
                       help="a label selector of decode worker pods (default: none)")
    serve.add_argument("--k8s-namespace", metavar="NAMESPACE",
                       help="where the worker pods are (default: the gateway pod's namespace)")
    serve.add_argument("--k8s-port", type=int, metavar="PORT",
                       help=f"a worker pod's port when it names none 'http' (default: {gw.k8s_port})")
    serve.set_defaults(func=cmd_cloud_serve)

    add_keys_parser(cloud)


def _speculative_flags(parser, eng, prefix: str) -> None:
    """``--speculative`` and ``--num-speculative-tokens``: the engine's own speculation ([engine]
    speculative, num_speculative_tokens); a device's draft (cascade.draft) is verified either way."""
    parser.add_argument("--speculative", choices=["ngram", "none"],
                        help=f"{prefix}ngram: prompt-lookup speculative decoding (each decode step also "
                             f"verifies up to --num-speculative-tokens tokens found earlier in the request); "
                             f"none: off (default: {eng.speculative or 'none'})")
    parser.add_argument("--num-speculative-tokens", type=int, help=f"{prefix}tokens proposed per decode step, "
                                                                   f"1..64 (default: {eng.num_speculative_tokens})")


def _speculative(args) -> dict:
    """The [engine] overrides the speculation flags make (none when not given)."""
    out = {"num_speculative_tokens": args.num_speculative_tokens}
    if args.speculative is not None:
        out["speculative"] = "" if args.speculative == "none" else args.speculative
    return out
