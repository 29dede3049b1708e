"""Write one Megatron-LM export per kind of plan, for ``tools/check_megatron_export.py``.

    python tools/megatron_export_cases.py OUT_DIR
    python tools/check_megatron_export.py MEGATRON_LM_DIR OUT_DIR/*.sh

Kinds (the plans issue 24's review ran through Megatron's parser, and one of each export feature): ZeRO 0, the
distributed optimizer (ZeRO 1), Megatron-FSDP (ZeRO 2 and 3), interleaved 1F1B, uneven first/last pipeline
chunks, selective and full recompute, context parallelism (Llama-3-8B cp 4, Llama-3-70B at 131,072 tokens cp 16),
GQA, and a Mixture of Experts with expert parallelism (Mixtral-8x7B). Each plan is the layout its framework
settings describe (``fixtures/export_plans.plan_from_settings``), exported by :func:`planner.export.api.export_plan`.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fixtures.export_plans import plan_from_settings  # noqa: E402
from planner.cli.common import resolve_cluster_path  # noqa: E402
from planner.export import (  # noqa: E402
    FrameworkSettings,
    export_plan,
)
from planner.model import parse_model  # noqa: E402
from planner.profile import (  # noqa: E402
    build_gpt_profile,
    load_cluster_profile,
)

# name: (model, seq, settings)
CASES = {
    "gpt3-175b_zero1_interleaved": ("gpt:gpt3-175b", 2048, dict(tp=8, pp=16, dp=8, zero_stage=1,
        schedule="interleaved_1f1b", virtual_stages=2, micro_batch=1, global_batch=512, sequence_parallel=True)),
    "gpt3-175b_fsdp": ("gpt:gpt3-175b", 2048, dict(tp=8, dp=128, zero_stage=3, micro_batch=1, global_batch=1024,
        sequence_parallel=True, recompute="full")),
    "korthikanti-1t_zero1_selective": ("gpt:korthikanti-1t", 2048, dict(tp=8, pp=64, dp=4, zero_stage=1,
        micro_batch=1, global_batch=512, sequence_parallel=True, recompute="selective")),
    "megatron-1.7b_zero2": ("gpt:megatron-1.7b", 2048, dict(tp=1, dp=32, zero_stage=2, micro_batch=4,
        global_batch=256)),
    "megatron-1.7b_zero0": ("gpt:megatron-1.7b", 2048, dict(tp=2, pp=2, dp=8, micro_batch=2, global_batch=64)),
    "megatron-7.5b_uneven": ("gpt:megatron-7.5b", 2048, dict(tp=2, pp=4, dp=4, micro_batch=1, global_batch=64,
        first_chunk_blocks=6, last_chunk_blocks=6)),
    "llama3-8b_cp4": ("llama:llama3-8b", 32768, dict(tp=2, cp=4, dp=2, zero_stage=1, micro_batch=1,
        global_batch=16, sequence_parallel=True, context_parallel="allgather", flash_attention=True)),
    "llama3-70b_cp16_fsdp": ("llama:llama3-70b", 131072, dict(tp=8, cp=16, dp=4, zero_stage=3, micro_batch=1,
        global_batch=64, sequence_parallel=True, context_parallel="allgather", flash_attention=True,
        recompute="full")),
    "mixtral-8x7b_ep8": ("moe:mixtral-8x7b", 4096, dict(tp=2, ep=8, dp=16, zero_stage=1, micro_batch=1,
        global_batch=256, sequence_parallel=True)),
    "mixtral-8x7b_ep4_fsdp": ("moe:mixtral-8x7b", 4096, dict(tp=1, ep=4, dp=32, zero_stage=3, micro_batch=1,
        global_batch=256)),
}  # fmt: skip


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    cluster = load_cluster_profile(resolve_cluster_path("dgx-a100-80g"))
    for name, (model, seq, kw) in CASES.items():
        spec = parse_model(model)
        settings = FrameworkSettings(seq_len=seq, dtype="bf16", model=spec, weight_decay=0.1, **kw)
        plan = plan_from_settings(settings, spec)
        profile = build_gpt_profile(spec, seq_len=seq, dtype="bf16")
        export = export_plan(plan, "megatron", profile=profile, cluster=cluster)
        changed = "; ".join(c.line() for c in export.changes) or "exact"
        (out / f"{name}.sh").write_text(export.text, encoding="utf-8")
        print(f"{name}: {settings.world_size} GPUs ({changed})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
