"""Small synthetic profiles with round numbers, shared by the cost-model tests (no tests here)."""

from __future__ import annotations

from planner.model import ModelSpec
from planner.profile import (
    ClusterProfile,
    CollectiveFit,
    CollectiveNeed,
    ComputeFigure,
    LayerProfile,
    ModelProfile,
    NodeGroup,
    NodeType,
    Provenance,
    ShardProfile,
)

PEAK = 100e12
RATE = 50e12  # achieved FLOP/s
MEM_BW = 1e12  # bytes/s
INTRA_BW = 100e9
INTER_BW = 10e9
INTRA_ALPHA = 6e-6  # per collective at n=4 all-reduce -> 1 us per ring step
INTER_ALPHA = 30e-6  # at n=16 all-reduce -> 1 us per step


def fits(level: str, alpha: float, bw: float, n: int) -> list[CollectiveFit]:
    out = []
    for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "all_to_all"):
        steps = {"all_reduce": 2 * (n - 1), "send_recv": 1}.get(op, n - 1)
        out.append(
            CollectiveFit(
                op=op,
                level=level,
                n_ranks=n if op != "send_recv" else 2,
                alpha_s=alpha / (2 * (n - 1)) * steps,
                bus_bw_bytes_per_s=bw,
                origin="derived",
                source="test",
            )
        )
    return out


def node(name: str = "gpu4", devices: int = 4, mem: int = 80 * 2**30, device: str = "Test GPU") -> NodeType:
    return NodeType(
        name=name,
        device=device,
        devices_per_node=devices,
        device_memory_bytes=mem,
        device_memory_source="test",
        memory_bw_bytes_per_s=MEM_BW,
        compute=[
            ComputeFigure(
                dtype="bf16", peak_flops_per_s=PEAK, achieved_flops_per_s=RATE, origin="derived", source="test"
            )
        ],
        intra_node=fits("intra_node", INTRA_ALPHA, INTRA_BW, devices),
    )


def cluster(nodes: int = 4, devices: int = 4) -> ClusterProfile:
    return ClusterProfile(
        name="test",
        node_types=[node(devices=devices)],
        nodes=[NodeGroup(node_type="gpu4", count=nodes)],
        inter_node=fits("inter_node", INTER_ALPHA, INTER_BW, 16),
        provenance=Provenance(method="datasheet", tool="test", created_utc=""),
    )


def block(
    path: str,
    *,
    tps=(1, 2, 4),
    saved: float = 0.0,
    fwd_flops: float = 1e12,
    params: int = 1_000_000,
    act_bytes: float = 1e6,
) -> LayerProfile:
    shards = [
        ShardProfile(
            tp=t,
            params=params // t,
            param_bytes=2 * params // t,
            fwd_flops_per_sample=fwd_flops / t,
            bwd_flops_per_sample=2 * fwd_flops / t,
            saved_bytes_per_sample=saved / t,
        )
        for t in tps
    ]
    needs = [
        CollectiveNeed(op="all_reduce", phase=phase, bytes_per_sample=act_bytes) for phase in ("forward", "backward")
    ]
    return LayerProfile(
        path=path,
        kind="block",
        signature="b",
        tp_style="megatron_block",
        input_bytes_per_sample=act_bytes,
        output_bytes_per_sample=act_bytes,
        shards=shards,
        collectives=needs,
    )


def model(n_blocks: int = 2, **kw) -> ModelProfile:
    layers = [block(f"blocks.{i}", **kw) for i in range(n_blocks)]
    return ModelProfile(
        name="test",
        model=ModelSpec(family="mlp", dims={}),
        seq_len=1,
        dtype="bf16",
        sample_shape=[1],
        micro_batches=[1],
        tp_degrees=[1, 2, 4],
        total_params=sum(layer.params for layer in layers),
        layers=layers,
        provenance=Provenance(method="analytic", tool="test", created_utc=""),
    )
