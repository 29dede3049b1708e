"""The ``stratagem`` command. The CLI is the one composition root: it may import ``runtime``."""

from planner.cli.cmd_profile_cluster import parse_size, parse_sizes, poor_fit_warnings
from planner.cli.common import PROFILES_DIR, resolve_cluster_path
from planner.cli.compare_cli import build_comparison
from planner.cli.main import SETTING_FLAGS, build_parser, main

__all__ = [
    "PROFILES_DIR",
    "SETTING_FLAGS",
    "build_comparison",
    "build_parser",
    "main",
    "parse_size",
    "parse_sizes",
    "poor_fit_warnings",
    "resolve_cluster_path",
]
