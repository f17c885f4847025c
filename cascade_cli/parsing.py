"""How every ``cascade`` subcommand's parser is made and how its ``--help`` reads: each flag with
its default."""

from __future__ import annotations

import argparse


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where there is none to show (``None``, off switches) or
    the help already names it (flags whose value comes from the config say so themselves)."""

    def _get_help_string(self, action):
        if action.default in (None, False, argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_command(sub, name: str, help_: str, **kw) -> argparse.ArgumentParser:
    """A subcommand under ``sub`` whose help is also its description, flags shown with defaults."""
    return sub.add_parser(name, help=help_, description=help_, formatter_class=DefaultsHelp, **kw)


def int_in(low: int, high: int):
    """An argparse type: an integer in ``low..high`` (else argparse's one-line error, exit 2)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in {low}..{high}, got {text}")
        return value
    return parse
