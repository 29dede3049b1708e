"""The words of a parallel layout and of precision, defined once: the plan file, the profiles, the cost model, the
search, the exports and the CLI's choices all use these. A ``Literal`` type for annotations and pydantic fields,
and its values as a tuple for ``argparse`` choices and loops."""

from __future__ import annotations

from typing import Final, Literal, get_args

Dtype = Literal["fp32", "tf32", "bf16", "fp16", "fp8"]
DTYPES: Final[tuple[str, ...]] = get_args(Dtype)  # the --dtype choices of every command that takes one
# Bytes per element of the compute dtype.
DTYPE_BYTES: Final = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}

# How 16-bit compute is executed (planner.profile.autocast): "pure" = 16-bit weights and activations throughout
# (Megatron-LM, torchtitan); "autocast" = fp32 weights under torch.autocast (Stratagem's runtime).
Precision = Literal["pure", "autocast"]
PRECISIONS: Final[tuple[str, ...]] = get_args(Precision)  # the --precision choices of plan and estimate

ScheduleKind = Literal["gpipe", "1f1b", "interleaved_1f1b"]
SCHEDULES: Final[tuple[str, ...]] = get_args(ScheduleKind)
# the spellings the CLI and the runs CSV accept for a schedule
SCHEDULE_ALIASES: Final[dict[str, ScheduleKind]] = {
    "gpipe": "gpipe",
    "1f1b": "1f1b",
    "interleaved": "interleaved_1f1b",
    "interleaved_1f1b": "interleaved_1f1b",
    "interleaved-1f1b": "interleaved_1f1b",
}
Recompute = Literal["none", "selective", "full"]
RECOMPUTE_MODES: Final[tuple[str, ...]] = get_args(Recompute)
TPStyle = Literal["replicate", "split"]
ContextMode = Literal["allgather", "ring"]
CONTEXT_MODES: Final[tuple[str, ...]] = get_args(ContextMode)
