"""Mixture-of-Experts cost model against published training runs (benchmarks/data/moe_runs.csv).

For each row: the model from the row's dimensions (family ``moe``; a head width other than hidden / heads, as
Qwen3's, through ``build_moe_profile(head_dim=...)``), the row's parallel configuration on the
shipped ``dgx-h100`` profile, BF16, fused (flash) attention as Megatron-Core's Transformer Engine runs it,
and the predicted step time against the published one (a TFLOP/s figure is turned into a step time with the
cost model's own FLOP count: ``published_step = predicted_flops_per_gpu_per_step / published_tflops``).
Printed twice: with the cited default load imbalance (``MOE_LOAD_IMBALANCE``, Switch Transformer's 1.25)
and with the imbalance fitted on the Mixtral row only, with the error of the other rows at that value.
Never a timed test.

    .venv/bin/python benchmarks/moe_validation.py
"""

from __future__ import annotations

import csv
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.cli.common import resolve_cluster_path  # noqa: E402
from planner.cost import estimate  # noqa: E402
from planner.cost.config import ParallelConfig  # noqa: E402
from planner.cost.constants import MOE_LOAD_IMBALANCE  # noqa: E402
from planner.cost.placement import with_gpus  # noqa: E402
from planner.moe_profile import build_moe_profile  # noqa: E402
from planner.modelspec import parse_model  # noqa: E402
from planner.profiles import load_cluster_profile  # noqa: E402

CSV = ROOT / "benchmarks" / "data" / "moe_runs.csv"
FIT_ROW = "mixtral-8x7b-64xh100"


def load_rows() -> list[dict[str, str]]:
    with open(CSV, newline="") as fh:
        return list(csv.DictReader(fh))


def _setup(row: dict[str, str]):
    spec = parse_model(
        "moe",
        layers=int(row["layers"]),
        hidden=int(row["hidden"]),
        heads=int(row["heads"]),
        kv_heads=int(row["kv_heads"]),
        vocab=int(row["vocab"]),
        max_seq=int(row["seq_len"]),
        experts=int(row["experts"]),
        top_k=int(row["top_k"]),
        expert_ffn=int(row["expert_ffn"]),
        shared_experts=int(row["shared_experts"]),
    )
    head_dim = int(row["head_dim"])  # Qwen3: 128 with hidden 4096 and 64 heads (planner.moe_profile)
    profile = build_moe_profile(
        spec,
        seq_len=int(row["seq_len"]),
        dtype="bf16",
        head_dim=None if head_dim * spec.dims["heads"] == spec.dims["hidden"] else head_dim,
    )
    cluster = with_gpus(load_cluster_profile(resolve_cluster_path("dgx-h100")), int(row["gpus"]))
    dp, batch, mb = int(row["dp"]), int(row["global_batch"]), int(row["micro_batch"])
    v = int(row["virtual_stages"])
    config = ParallelConfig(
        tp=int(row["tp"]),
        pp=int(row["pp"]),
        dp=dp,
        ep=int(row["ep"]),
        etp=int(row["etp"]),
        micro_batch=mb,
        num_micro_batches=batch // (dp * mb),
        schedule="interleaved_1f1b" if v > 1 else "1f1b",
        virtual_stages=v,
        zero_stage=int(row["zero_stage"]),
        sequence_parallel=int(row["tp"]) > 1,  # Megatron-Core requires it with EP and TP
        recompute=row["recompute"],  # type: ignore[arg-type]
        flash_attention=True,
    )
    return profile, cluster, config, batch


def predict(row: dict[str, str], imbalance: float) -> tuple[float, float, object]:
    """(predicted step s, published step s, estimate) of one row at load imbalance ``imbalance``."""
    profile, cluster, config, batch = _setup(row)
    est = estimate(profile, cluster, replace(config, moe_load_imbalance=imbalance), global_batch=batch)
    value = float(row["measured_value"])
    if row["measured_metric_name"] == "model_tflops_per_gpu":
        published = est.model_tflops_per_gpu * est.step_time_s / value
    else:
        published = value
    return est.step_time_s, published, est


def fit_imbalance(row: dict[str, str]) -> float:
    """The load imbalance (>= 1) at which ``row``'s prediction equals the published step (bisection)."""
    lo, hi = 1.0, 2.0
    if predict(row, lo)[0] >= predict(row, lo)[1]:
        return lo
    for _ in range(40):
        mid = (lo + hi) / 2
        step, published, _ = predict(row, mid)
        lo, hi = (mid, hi) if step < published else (lo, mid)
    return (lo + hi) / 2


def main() -> int:
    rows = load_rows()
    fitted = fit_imbalance(next(r for r in rows if r["run"] == FIT_ROW))
    for label, lam in ((f"cited default {MOE_LOAD_IMBALANCE}", MOE_LOAD_IMBALANCE), (f"fitted on {FIT_ROW}", fitted)):
        print(f"\nload imbalance {lam:.3f} ({label})")
        print(f"{'run':38s} {'layout':28s} {'published_s':>11s} {'predicted_s':>11s} {'error':>7s}  shape  ep_comm_s")
        for row in rows:
            step, published, est = predict(row, lam)
            layout = f"tp{row['tp']} pp{row['pp']} dp{row['dp']} ep{row['ep']} v{row['virtual_stages']}"
            print(
                f"{row['run']:38s} {layout:28s} {published:11.2f} {step:11.2f} {step / published - 1:+7.1%}  "
                f"{row['shape_exact']:5s}  {est.breakdown_s.get('ep_comm', 0.0):.2f}  ({row['dispatcher']})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
