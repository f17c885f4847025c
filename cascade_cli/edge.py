"""``cascade edge``: the device daemon (``run``), its systemd unit (``install-service``), what the
device has (``hardware``, hardware.py) and its offline queue (``queue``, edge_queue.py: not
queue.py, which would shadow the standard library's ``queue`` for a script run from this folder)."""

from __future__ import annotations

import os
import sys

from cascade_cli.parsing import add_command


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
    from model_distribution.artifacts.catalog import ModelNotFound
    from model_distribution.artifacts.onnx_model import OnnxModelError

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



def cmd_edge_install_service(args) -> int:
    from pathlib import Path

    from cascade.config import ConfigError
    from cascade_cli.spawn import cascade_executable
    from edge_agent.config import AgentServerConfig, EdgeConfig
    from edge_agent.service_unit import DEFAULT_UNIT_PATH, ServiceSpec, next_steps, unit_text

    command = [args.exec] if args.exec else [args.python, "-m", "cascade_cli"] if args.python else cascade_executable()
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


def add_edge_parser(sub) -> None:
    """``cascade edge run|install-service|hardware|queue``."""
    from cascade_cli.edge_queue import add_queue_parser
    from cascade_cli.hardware import add_hardware_parser
    from edge_agent.config import AgentServerConfig, ModelConfig, QueueConfig

    edge_srv, edge_model, edge_queue = AgentServerConfig(), ModelConfig(), QueueConfig()
    edge = add_command(sub, "edge", "the device daemon and its offline queue").add_subparsers(
        dest="edge_command", required=True, metavar="COMMAND")
    run = add_command(edge, "run", "serve the OpenAI-compatible API from a local model (stop: Ctrl-C or SIGTERM)")
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

    svc = add_command(edge, "install-service", "write a systemd unit that runs `cascade edge run` as a service "
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

    add_hardware_parser(edge)
    add_queue_parser(edge)
