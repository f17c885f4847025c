"""``cascade demo``'s parser; the scenario (scenario.py) is imported when it runs."""

from __future__ import annotations

from cascade_cli.parsing import add_command


def cmd_demo(args) -> int:
    from cascade_cli.demo.scenario import run_demo

    return run_demo(args)


def add_demo_parser(sub) -> None:
    """``cascade demo [--port N]``."""
    demo = add_command(sub, "demo", "run the scripted end-to-end scenario on this machine")
    demo.add_argument("--port", type=int, default=0, help="edge agent port (0: a free one)")
    demo.set_defaults(func=cmd_demo)
