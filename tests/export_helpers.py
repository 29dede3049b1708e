"""Test fixtures for the exporters: a plan built directly from framework settings (an expressible plan)."""

from __future__ import annotations

from planner.export.api import layer_kinds
from planner.export.settings import FrameworkSettings, chunk_paths, to_parallel_config
from planner.gpt_profile import build_gpt_profile
from planner.modelspec import ModelSpec
from planner.plan import LayerLayout, Mesh, Plan, Stage, TrainingSettings, make_schedule
from planner.search.plan_file import stage_ranks

CLUSTER = "dgx-a100-80g"


def plan_from_settings(s: FrameworkSettings, spec: ModelSpec) -> Plan:
    """The plan a framework config describes: Megatron's layout (every TP-capable layer split), its chunks
    and recompute, on the A100 cluster. No predictions (the export estimates both sides itself)."""
    profile = build_gpt_profile(spec, seq_len=s.seq_len, dtype=s.dtype or "bf16")
    kinds = layer_kinds(profile)
    config = to_parallel_config(s, kinds)
    kind_of = dict(kinds)
    stages = []
    for i, paths in enumerate(chunk_paths(kinds, s)):
        if isinstance(config.recompute, str):
            recompute = {p: config.recompute for p in paths if kind_of[p] == "block" and config.recompute != "none"}
        else:
            recompute = {p: m for p, m in config.recompute.items() if p in paths}
        stages.append(
            Stage(
                index=i,
                pp_rank=i % s.pp,
                module_paths=paths,
                node_type=CLUSTER,
                recompute=recompute,
                ranks=stage_ranks(i % s.pp, dp=s.dp, tp=s.tp),
            )
        )
    layout = {
        layer.path: LayerLayout(
            style="split" if s.tp > 1 and layer.tp_style != "none" else "replicate",
            sequence_parallel=s.sequence_parallel and s.tp > 1 and layer.tp_style != "none",
        )
        for layer in profile.layers
    }
    return Plan(
        planner_version="test",
        created_utc="",
        model=spec,
        model_profile_hash=None,
        cluster_name=CLUSTER,
        cluster_hash=None,
        training=TrainingSettings(
            global_batch=s.global_batch,
            seq_len=s.seq_len,
            dtype=s.dtype,
            lr_schedule=s.lr_schedule,
            weight_decay=s.weight_decay or 0.0,
        ),
        mesh=Mesh(sizes=[s.pp, s.dp, s.tp]),
        schedule=make_schedule(
            s.schedule,
            micro_batch_size=s.micro_batch,
            global_batch=s.global_batch,
            dp=s.dp,
            num_micro_batches=s.num_micro_batches,
            virtual_stages=s.virtual_stages,
        ),
        stages=stages,
        layout=layout,
        zero_stage=s.zero_stage,
    )
