"""Result records of the cost model: per chunk, per pipeline rank, and the whole-step :class:`Estimate`."""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.cost.memory import MemoryBreakdown
from planner.plan import Predictions, ReplicaTypePrediction, StagePrediction

BREAKDOWN_KEYS = (
    "forward",
    "backward",
    "recompute",
    "tp_comm",
    "pp_comm",
    "bubble",
    "dp_sync_exposed",
    "dp_sync_overlapped",
    "zero_comm",
    "optimizer",
)
FLOP_CONVENTION = (
    "model FLOPs = forward + backward FLOPs of the profile (GPT: 72 B s l h^2 (1 + s/6h + V/12lh), SC21 eq. 3 "
    "without the recompute forward); hardware FLOPs add recomputed forwards (SC21 eq. 3 itself under full "
    "recompute); with causal flash attention (ParallelConfig.causal_skip) the s^2 attention terms count the causal "
    "half; MFU/HFU divide by the datasheet dense peak of the compute dtype (PaLM App. B)"
)


def _stage_predictions(chunks, ranks) -> list[StagePrediction]:
    """One :class:`StagePrediction` per chunk, with its pp rank's memory."""
    stages = []
    for chunk in chunks:
        mem = ranks[chunk.pp_rank].memory
        breakdown = {k: v for k, v in mem.as_dict().items() if k != "capacity"}
        stages.append(
            StagePrediction(
                stage=chunk.index,
                time_breakdown_s=dict(chunk.time_s),
                memory_breakdown_bytes=breakdown,
                peak_memory_bytes=mem.peak_bytes,
                memory_capacity_bytes=mem.capacity,
            )
        )
    return stages


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkEstimate:
    """One pipeline chunk (stage) for one micro-batch on one of its ranks."""

    index: int
    pp_rank: int
    node_type: str
    module_paths: tuple[str, ...]
    time_s: dict[str, float]  # forward, backward, recompute, tp_comm, layout, pp_comm, [ep_comm] (per micro-batch)
    model_flops: float
    hardware_flops: float

    @property
    def total_s(self) -> float:
        return sum(self.time_s.values())


@dataclass(frozen=True, kw_only=True, slots=True)
class RankEstimate:
    """One pipeline rank: its micro-batch time over all chunks, per-step tails, and peak memory."""

    pp_rank: int
    node_type: str
    microbatch_s: float
    inflight_microbatches: float
    dp_sync_s: float
    dp_sync_exposed_s: float
    zero_comm_s: float
    optimizer_s: float
    memory: MemoryBreakdown
    expert_step_s: float = 0.0  # MoE: expert gradients' edp sync + ZeRO gather + AdamW (planner.cost.moe)

    @property
    def tail_s(self) -> float:
        return self.dp_sync_exposed_s + self.zero_comm_s + self.optimizer_s + self.expert_step_s


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaTypeEstimate:
    """The dp replicas of one node type (``ParallelConfig.replica_node_types``): their pipeline time with
    ``micro_batches`` (``m_t``, formula (P) of ``pipeline.py``) and their ranks, tails and memory."""

    node_type: str
    replicas: tuple[int, ...]
    micro_batches: int
    batch_share_total: float
    pipeline_s: float
    per_rank: tuple[RankEstimate, ...]
    per_stage: tuple[ChunkEstimate, ...] = ()

    @property
    def tail_s(self) -> float:
        """The largest per-step tail over this type's pp ranks."""
        return max(rk.tail_s for rk in self.per_rank)


@dataclass(frozen=True, kw_only=True, slots=True)
class Estimate:
    """Predicted step time and memory of one configuration (all times in seconds, memory in bytes)."""

    step_time_s: float
    tokens_per_s: float
    samples_per_s: float
    model_tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    mfu: float
    hfu: float
    peak_memory_bytes: float
    fits_in_memory: bool
    breakdown_s: dict[str, float]
    per_stage: tuple[ChunkEstimate, ...]
    per_rank: tuple[RankEstimate, ...]
    flop_convention: str = FLOP_CONVENTION
    notes: tuple[str, ...] = field(default_factory=tuple)
    # One record per distinct replica node type when ``ParallelConfig.replica_node_types`` is set; then
    # ``per_stage``/``per_rank`` are those of the critical type (largest pipeline_s + tail_s). Else empty.
    per_replica_type: tuple[ReplicaTypeEstimate, ...] = ()

    def to_predictions(self) -> Predictions:
        """The plan file's :class:`Predictions`, one :class:`StagePrediction` per chunk (and per replica
        node type in ``per_replica_type`` when replicas run on several)."""
        return Predictions(
            step_time_s=self.step_time_s,
            tokens_per_s=self.tokens_per_s,
            samples_per_s=self.samples_per_s,
            model_tflops_per_gpu=self.model_tflops_per_gpu,
            hardware_tflops_per_gpu=self.hardware_tflops_per_gpu,
            mfu=self.mfu,
            peak_memory_bytes=self.peak_memory_bytes,
            breakdown_s=dict(self.breakdown_s),
            stages=_stage_predictions(self.per_stage, self.per_rank),
            per_replica_type=[
                ReplicaTypePrediction(
                    node_type=t.node_type,
                    replicas=list(t.replicas),
                    micro_batches=t.micro_batches,
                    pipeline_s=t.pipeline_s,
                    stages=_stage_predictions(t.per_stage, t.per_rank),
                )
                for t in self.per_replica_type
            ],
        )
