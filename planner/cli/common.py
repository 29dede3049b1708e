"""Argument helpers shared by the subcommands: int lists, cluster lookup, terminal output."""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import platform
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from planner.core import StratagemError
from planner.profile import PROFILES_DIR, ClusterProfile, ModelProfile, resolve_cluster_path  # noqa: F401

# Upper bounds of count flags: far above any real job, low enough that loops over divisors, layers or ranks
# finish in well under a second (a 20-digit --gpus made the search enumerate for ever).
MAX_DEVICES = 2**20  # ranks / GPUs in one job (the largest published runs use ~2**15)
MAX_BATCH = 2**20  # samples per optimizer step
MAX_SEQ = 2**22  # tokens per sample
MAX_LAYERS = 10_000  # transformer blocks (published models: <= 128)
MAX_WIDTH = 2**22  # hidden, ffn, vocab sizes and head counts
MAX_SECONDS = 7 * 86_400.0  # time limits: one week


def int_in(low: int, high: int, *, what: str = "") -> Callable[[str], int]:
    """argparse ``type=``: an integer in ``low..high`` (a decimal literal; no floats, no NaN).

    >>> int_in(1, 8)("4")
    4
    >>> int_in(1, 8)("0")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: expected an integer 1..8, got '0'
    """

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer {low}..{high}{what}, got {text!r}")
        return value

    parse.__name__ = "integer"
    return parse


def float_in(
    low: float, high: float, *, low_open: bool = False, high_open: bool = False, what: str = ""
) -> Callable[[str], float]:
    """argparse ``type=``: a finite number between ``low`` and ``high`` (open ends excluded).

    >>> float_in(0, 1, low_open=True)("0.5")
    0.5
    >>> float_in(0, 1, low_open=True)("nan")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: expected a number > 0 and <= 1, got 'nan'
    """
    lo_text = f"> {low:g}" if low_open else f">= {low:g}"
    hi_text = f"< {high:g}" if high_open else f"<= {high:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        ok = (
            math.isfinite(value)
            and (value > low if low_open else value >= low)
            and (value < high if high_open else value <= high)
        )
        if not ok:
            raise argparse.ArgumentTypeError(f"expected a number {lo_text} and {hi_text}{what}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


def int_list(text: str, *, high: int = MAX_BATCH, flag: str = "size list") -> list[int]:
    """Parse ``"1,2,4"`` into ``[1, 2, 4]``; integers in ``1..high`` only.

    >>> int_list("1,2,4")
    [1, 2, 4]
    """
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(not 1 <= v <= high for v in values):
        raise StratagemError(f"malformed {flag} {text!r}; write integers 1..{high} separated by commas, e.g. 1,2,4")
    return values


def nonempty_path(text: str) -> Path:
    """argparse ``type=`` for file and folder flags: an empty or blank string is an error, not '.'."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    return Path(text)


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
        return super()._get_help_string(action) or text


def check_layer_paths(spec, paths: list[str], *, source: str) -> None:
    """``paths`` (a profile's layers or a plan's stages, in order) must be the model's top-level layers.

    The CLI is the one place the planner may ask the runtime's model zoo (the composition root); zoo models'
    paths need no torch (``runtime.models.paths``)."""
    from runtime.models.paths import spec_layer_paths

    try:
        expected = spec_layer_paths(spec)
    except KeyError:  # a family this build's model zoo does not have (e.g. moe before its runtime lands)
        raise StratagemError(
            f"this build's runtime model zoo has no {spec.family} models, so {source} cannot be checked against "
            f"{spec.name}; install a Stratagem whose runtime builds {spec.family} models"
        ) from None
    if list(paths) != expected:
        unknown = [p for p in paths if p not in expected][:3]
        detail = f"unknown {unknown}" if unknown else f"{len(paths)} layers, expected {len(expected)} in model order"
        raise StratagemError(
            f"{source} does not match the layers of {spec.name} ({detail}); regenerate it for this model"
        )


def no_ellipsis(table):
    """Make a rich table readable at 80 columns: no column narrower than its longest header word, and cells
    that do not fit wrap (fold) instead of ending in an ellipsis."""
    for column in table.columns:
        words = str(column.header).split() or [""]
        column.min_width = max(column.min_width or 0, *(len(w) for w in words))
        column.overflow = "fold"
        column.no_wrap = False
    return table


def throughput_text(samples_per_s: float, tokens_per_s: float, family: str) -> str:
    """Tokens/s for language models, images/s for image models, samples/s otherwise."""
    if family in ("gpt", "llama", "moe"):
        return f"{tokens_per_s:,.0f} tokens/s, {samples_per_s:,.2f} samples/s"
    unit = "images/s" if family == "resnet" else "samples/s"
    return f"{samples_per_s:,.2f} {unit}"


def out_path(text: str) -> Path:
    """argparse ``type=`` for output files: empty strings and folder names (a trailing ``/``) are errors,
    caught here because ``Path("dir/")`` silently drops the slash."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a file path, got an empty string")
    if text.endswith(("/", os.sep, "/.", "/..")) or text in (".", ".."):
        raise argparse.ArgumentTypeError(
            f"expected a file path, got the folder name {text!r}; add a file name, e.g. {text.rstrip('/')}/out.json"
        )
    return Path(text)


def check_out_path(path: str | os.PathLike, *, flag: str = "--out", inputs: dict | None = None) -> Path:
    """Fail before any work if ``path`` cannot be written (see :func:`planner.core.fileio.check_output_path`)."""
    from planner.core import check_output_path

    return check_output_path(path, flag=flag, inputs=inputs)


def flash_attention_default(flag: bool | None, cluster: ClusterProfile) -> bool:
    """``--flash-attention`` / ``--no-flash-attention`` of `plan` and `estimate`, else on when every node type of
    the cluster is a GPU (what `stratagem launch` then runs: fused SDPA, runtime.models.attention)."""
    from planner.core import is_gpu

    if flag is not None:
        return bool(flag)
    return all(is_gpu(nt.device) for nt in cluster.node_types)


def add_moe_imbalance(p) -> None:
    """``--moe-imbalance``: dropless MoE routing's load imbalance (plan and estimate)."""
    from planner.core import MOE_LOAD_IMBALANCE, MOE_ROUTER_IMBALANCE

    fits = ", ".join(f"{family} {value:g}" for family, (value, _) in MOE_ROUTER_IMBALANCE.items())
    p.add_argument(
        "--moe-imbalance",
        type=float_in(1.0, 16.0),
        default=None,
        metavar="X",
        help="dropless Mixture-of-Experts routing: the busiest expert-parallel rank's tokens over the mean "
        f"(default: the model's router fit where one is published — {fits} — else {MOE_LOAD_IMBALANCE:g})",
    )


def moe_imbalance(flag: float | None, model_name: str) -> tuple[float, str]:
    """(load imbalance, a note saying where it comes from) for ``--moe-imbalance`` on ``model_name``."""
    if flag is not None:
        return flag, f"MoE load imbalance {flag:g} (--moe-imbalance)"
    from planner.cost import default_load_imbalance

    value, source = default_load_imbalance(model_name)
    return value, f"MoE load imbalance {value:g}: {source} (--moe-imbalance overrides)"


def analytic_on_cpu_note(profile: ModelProfile, cluster: ClusterProfile) -> str | None:
    """An analytic (datasheet) profile on CPU devices has no per-op framework time, which dominates small
    models there: say so, with the fix, instead of printing a step time 10-100x too short unannounced."""
    from planner.core import is_gpu

    if profile.provenance.method != "analytic" or all(is_gpu(nt.device) for nt in cluster.node_types):
        return None
    return (
        f"{profile.name} is an analytic profile and {cluster.name} has CPU devices: predicted times leave out "
        f"per-op framework overhead, which dominates small models on CPUs (10-100x here); measure the model with "
        f"`stratagem profile model` and pass --model-profile for step times to trust"
    )


DEFAULT_MEMORY_MARGIN = 0.1


def memory_fraction_of(args: argparse.Namespace) -> float:
    """The share of device memory a plan may use, from --memory-margin or --memory-fraction (not both)."""
    if args.memory_margin is not None and args.memory_fraction is not None:
        raise StratagemError(
            "--memory-margin and --memory-fraction say the same thing (margin = 1 - fraction); pass one of them"
        )
    if args.memory_fraction is not None:
        return args.memory_fraction
    return 1.0 - (DEFAULT_MEMORY_MARGIN if args.memory_margin is None else args.memory_margin)
