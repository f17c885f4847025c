"""The ``cascade`` command: the top-level parser, composed of one module per group (edge.py,
models.py, fleet.py, cloud.py, calibrate/, demo/). Subcommands import their package lazily, so
that ``cascade edge`` never loads torch and ``cascade models list`` loads no model."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import cascade
from cascade_cli.parsing import DefaultsHelp

# Every process we start: OpenMP threads (llama.cpp, torch) must not spin-wait on 2 cores, unless
# given a bounded spin (GOMP_SPINCOUNT: what `cascade cloud serve` gives a worker of 2+ threads).
if "GOMP_SPINCOUNT" not in os.environ:
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")


def _log_level(value: str) -> str:
    if value.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise argparse.ArgumentTypeError(f"{value!r} is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
    return value.upper()


def build_parser() -> argparse.ArgumentParser:
    from cascade_cli.calibrate.command import add_calibrate_parser
    from cascade_cli.cloud import add_cloud_parser
    from cascade_cli.demo.command import add_demo_parser
    from cascade_cli.edge import add_edge_parser
    from cascade_cli.fleet import add_fleet_parser
    from cascade_cli.models import add_models_parser

    p = argparse.ArgumentParser(prog="cascade", formatter_class=DefaultsHelp,
                                description="Edge-cloud LLM serving: the edge agent, the cloud tier, calibration, "
                                            "and the demo. Every config key is also an environment variable "
                                            "CASCADE_<DEPLOYABLE>_<SECTION>_<KEY>; flags win over both.")
    p.add_argument("--version", action="version", version=f"cascade {cascade.__version__}")
    p.add_argument("--log-level", default=os.environ.get("CASCADE_LOG_LEVEL", "INFO"), type=_log_level,
                   help="log level of this process and the workers it starts (default: $CASCADE_LOG_LEVEL, "
                        "else INFO); logs go to standard error")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_group in (add_edge_parser, add_models_parser, add_fleet_parser, add_cloud_parser, add_calibrate_parser,
                      add_demo_parser):
        add_group(sub)
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
