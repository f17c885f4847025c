"""How every ``cascade`` subcommand's ``--help`` reads: each flag with its default."""

from __future__ import annotations

import argparse


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where there is none to show (``None``, off switches) or
    the help already names it (flags whose value comes from the config say so themselves)."""

    def _get_help_string(self, action):
        if action.default in (None, False, argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)
