"""Argument helpers shared by the subcommands: int lists, cluster lookup, terminal output."""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import shlex
import sys
from pathlib import Path

from planner.errors import StratagemError

from planner.profiles import SHIPPED_PROFILES_DIR as PROFILES_DIR  # package data (see planner/profiles.py)


def int_list(text: str) -> list[int]:
    """Parse ``"1,2,4"`` into ``[1, 2, 4]`` (argparse ``type=``); positive integers only."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise StratagemError(f"malformed size list {text!r}; write positive integers separated by commas, "
                             f"e.g. 1,2,4") from None
    if not values or any(v < 1 for v in values):
        raise StratagemError(f"malformed size list {text!r}; write positive integers separated by commas, "
                             f"e.g. 1,2,4")
    return values


def resolve_cluster_path(name_or_path: str) -> Path:
    """A shipped cluster profile's name (``dgx-a100-80g``) or a path to a profile file."""
    candidate = Path(name_or_path)
    if candidate.suffix == ".json" or candidate.exists():
        if not candidate.exists():
            raise StratagemError(f"cluster profile {candidate} does not exist; check the path")
        return candidate
    shipped = PROFILES_DIR / "hardware" / f"{name_or_path}.json"
    if shipped.exists():
        return shipped
    names = sorted(p.stem for p in (PROFILES_DIR / "hardware").glob("*.json"))
    raise StratagemError(f"unknown cluster {name_or_path!r}; use a shipped one ({', '.join(names)}) "
                         f"or a path to a profile file")


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def command_line() -> str:
    return "stratagem " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def host_name() -> str:
    return os.environ.get("HOSTNAME") or platform.node()


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Like argparse's, but shows no "(default: None/False)" and none where the help states its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return text
        return super()._get_help_string(action)


def check_out_path(path: Path) -> None:
    """Fail before any work if --out cannot be written (the write itself is atomic, at the end)."""
    if path.is_dir():
        raise StratagemError(f"--out {path} is a folder; give a file path such as {path / 'profile.json'}")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise StratagemError(f"cannot write {path}: {parent} is not a writable folder; choose a writable --out path")
