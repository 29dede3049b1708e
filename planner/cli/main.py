"""``stratagem`` entry point: builds the argument parser from the subcommand modules and runs one.

Each subcommand lives in its own module ``planner.cli.cmd_<name>`` with ``register(subparsers)`` that adds
its parser and sets ``func=run``. A :class:`StratagemError` becomes one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import NoReturn

from planner import __version__
from planner.cli.common import DefaultsHelpFormatter
from planner.core import SettingError, StratagemError

# library setting -> the flag that sets it (planner.core.errors.SettingError names settings, the CLI shows flags)
SETTING_FLAGS = {
    "allow": "--allow",
    "memory_fraction": "--memory-fraction",
    "time_limit_s": "--time-limit-s",
    "budget_s": "--budget-s",
    "jobs": "--jobs",
}

# (group, module) pairs; group None = top-level subcommand, "profile" = under `stratagem profile`, "tune" = under
# `stratagem tune`.
_COMMANDS: list[tuple[str | None, str]] = [
    ("profile", "cmd_profile_model"),
    ("profile", "cmd_profile_cluster"),
    (None, "cmd_estimate"),
    (None, "cmd_calibrate"),
    (None, "cmd_plan"),
    (None, "cmd_launch"),
    (None, "cmd_show"),
    (None, "cmd_export"),
    (None, "cmd_frontier"),
    ("tune", "cmd_tune_suggest"),
    ("tune", "cmd_tune_run"),
]


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors exit 2 with one line naming the fix."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="stratagem",
        description="Plan, run and inspect parallel training: profile -> plan -> launch -> show.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"stratagem {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    profile_sub = _group(
        sub,
        "profile",
        dest="what",
        help="measure (or derive) a model's or a cluster's profile",
        description="Write a versioned profile JSON for a model or a cluster.",
    )
    tune_sub = _group(
        sub,
        "tune",
        dest="how",
        help="model-guided trials: which configurations to measure next, or stop with the measured best",
        description="Calibrate on the runs measured so far and say which configurations to measure next.",
    )
    groups = {None: sub, "profile": profile_sub, "tune": tune_sub}
    for group, module_name in _COMMANDS:
        try:
            module = importlib.import_module(f"planner.cli.{module_name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"planner.cli.{module_name}":
                continue  # that subcommand is not part of this build yet
            raise
        module.register(groups[group])
    for action in (sub, profile_sub, tune_sub):  # -v also after the subcommand: `stratagem plan ... -v`
        for name, leaf in action.choices.items():
            if name not in ("profile", "tune"):
                leaf.add_argument(
                    "-v",
                    "--verbose",
                    action="store_true",
                    default=argparse.SUPPRESS,
                    help="log progress details to stderr",
                )
    return parser


def _group(sub: argparse._SubParsersAction, name: str, *, dest: str, help: str, description: str):  # noqa: A002
    """A command group (``stratagem profile``, ``stratagem tune``): its subcommands' parser; called alone it
    lists them."""
    parser = sub.add_parser(name, help=help, description=description)
    parser.set_defaults(func=lambda _args: _usage(parser))
    return parser.add_subparsers(dest=dest, metavar=dest.upper(), parser_class=_Parser)


def _usage(parser: argparse.ArgumentParser) -> int:
    """A group called without its subcommand (``stratagem profile``): list the subcommands, exit 2."""
    parser.print_help(sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # usage error (2) or --help/--version (0): a status, for in-process callers too
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what was typed (plan files record it)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except SettingError as exc:  # the library names its setting; the user set it with a flag
        print(f"error: {exc.render(SETTING_FLAGS)}", file=sys.stderr)
        return exc.exit_status
    except StratagemError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_status
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
