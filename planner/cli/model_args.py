"""The model arguments every command shares: ``--model`` plus the size overrides, and the profile check.

``--model`` is a zoo model (``gpt:tiny``, ``llama`` + overrides), a Hugging Face config (``hf:PATH``) or your own
``nn.Module`` (``py:FILE.py:FUNCTION``, ``module:pkg.mod:FUNCTION``). The same overrides (``--layers``,
``--hidden``, ...) work for every zoo family that has the dimension and for ``hf:`` configs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from planner.cli.common import MAX_LAYERS, MAX_WIDTH, check_layer_paths, float_in, int_in
from planner.core import StratagemError
from planner.model import ModelSpec, parse_model
from planner.profile import ModelProfile, load_model_profile

MODEL_HELP = (
    "gpt:tiny, llama:llama2-7b, gpt (+ size overrides), hf:CONFIG.json (a Hugging Face config or its "
    "folder), py:FILE.py:FUNCTION or module:pkg.mod:FUNCTION (your nn.Module; see README)"
)
# flag -> (ModelSpec dimension, help)
OVERRIDES = {
    "layers": ("layers", "transformer blocks, count"),
    "hidden": ("hidden", "hidden size, features per token"),
    "heads": ("heads", "attention heads, count"),
    "vocab": ("vocab", "vocabulary size, tokens"),
    "ffn-hidden": ("ffn_hidden", "MLP inner size, features (default 4 x hidden; llama: the 2/3 rule)"),
    "kv-heads": ("kv_heads", "key/value heads for grouped-query attention, count (llama, hf)"),
    "volume": ("volume", "voxels per side of the cubic input volume (unet3d, cosmoflow)"),
}
MAX_VOLUME = 4096  # voxels per side: 4096^3 already holds 6.9e10 voxels per channel


def add_model_arguments(parser: argparse.ArgumentParser, *, with_seq_override: bool = False) -> None:
    """``--model`` and the size overrides, in their own argument group."""
    group = parser.add_argument_group("model")
    group.add_argument("--model", required=True, help=MODEL_HELP)
    for flag, (_, what) in OVERRIDES.items():
        # bounded: a 20-digit --layers hung the search
        high = MAX_LAYERS if flag == "layers" else MAX_VOLUME if flag == "volume" else MAX_WIDTH
        group.add_argument(f"--{flag}", type=int_in(1, high), default=None, help=f"override the model's {what}")
    group.add_argument(
        "--dropout",
        type=float_in(0, 1, high_open=True),
        default=None,
        help="GPT dropout probability, 0 <= p < 1 (adds 1-byte masks to activation memory; Megatron used 0.1)",
    )


def spec_from_args(args: argparse.Namespace, *, max_seq: int | None = None) -> ModelSpec:
    """The full :class:`ModelSpec` that ``--model`` and the overrides describe (recorded in profiles and plans).

    Overrides the family does not have are dropped when not given and rejected when given
    (``parse_model`` names the valid ones). An ``hf:`` model passes the fidelity check first
    (``runtime.models.fidelity``: a tiny instance of it trains as transformers computes it) and carries its result.
    """
    overrides = {dim: getattr(args, flag.replace("-", "_"), None) for flag, (dim, _) in OVERRIDES.items()}
    overrides["dropout"] = getattr(args, "dropout", None)
    family = args.model.partition(":")[0]
    if family in ("gpt", "resnet", "mlp") and overrides.get("kv_heads") is None:
        overrides.pop("kv_heads")
    if family != "gpt" and overrides.get("dropout") is None:
        overrides.pop("dropout")
    if max_seq is not None and family in ("gpt", "llama", "moe", "hf"):
        overrides["max_seq"] = max_seq
    spec = parse_model(args.model, **overrides)
    if spec.family == "hf":  # the wrapper must compute transformers' logits, or the model is refused here
        from runtime.models.fidelity import check_hf_fidelity

        spec = spec.model_copy(update={"fidelity": check_hf_fidelity(spec)})
    return spec


def _comparable(spec: ModelSpec) -> dict:
    """What makes two specs the same model: family and every dimension with defaults applied (zoo), the whole
    config (hf), the function and the file's hash (custom). The preset name and hf file path do not count."""
    from planner.model import FAMILY_DEFAULTS

    if spec.family == "hf":
        return {
            "family": "hf",
            "config": {
                k: v for k, v in (spec.config or {}).items() if k not in ("transformers_version", "_name_or_path")
            },
        }
    if spec.family == "custom":
        return {"family": "custom", "source": spec.source, "config": spec.config}
    return {"family": spec.family, "dims": {**FAMILY_DEFAULTS[spec.family], **spec.dims}}


def check_profile_matches(profile_spec: ModelSpec, spec: ModelSpec, profile_path: Path) -> None:
    """One line at plan time when ``--model-profile`` was made for another model than ``--model`` describes."""
    if _comparable(profile_spec) == _comparable(spec):
        return
    mine, theirs = _comparable(spec), _comparable(profile_spec)
    if mine["family"] == theirs["family"] and "dims" in mine:
        diff = [
            f"{k} {theirs['dims'].get(k)} vs {mine['dims'].get(k)}"
            for k in sorted(mine["dims"])
            if theirs["dims"].get(k) != mine["dims"].get(k)
        ]
        detail = "; differs in " + ", ".join(diff[:4])
    else:
        detail = ""
    raise StratagemError(
        f"--model-profile {profile_path} profiles {profile_spec.name}, not {spec.name}{detail}; pass "
        f"the --model and size overrides it was profiled with, or re-profile"
    )


def load_matching_profile(path: str, spec: ModelSpec, seq: int | None) -> ModelProfile:
    """``--model-profile`` loaded and checked against ``--model`` (with its size overrides) and ``--seq``:
    a profile of another model, sequence or layer list is a one-line error naming the fix."""
    profile = load_model_profile(path)
    check_profile_matches(profile.model, spec, Path(path))
    if seq is not None and seq != profile.seq_len:
        raise StratagemError(
            f"--seq {seq} but {path} was profiled at seq {profile.seq_len}; drop --seq or re-profile with --seq {seq}"
        )
    check_layer_paths(profile.model, [layer.path for layer in profile.layers], source=f"--model-profile {path}")
    return profile
