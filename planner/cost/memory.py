"""Peak memory of one rank: model states sharded per ZeRO stage, activations in flight, buffers, reserve.

Assumptions (each term is reported separately; none is dropped):

- **Model states** — mixed-precision AdamW holds 2 + 2 + 12 bytes per parameter (16-bit weights and
  gradients; fp32 master, momentum, variance); under torch.autocast 4 + 4 + 8 (fp32 weights and gradients,
  :func:`state_dtype`). ZeRO (Rajbhandari et al. 2020 §5) shards the optimizer
  state over the data-parallel group at stage 1, also the gradients at stage 2, also the weights at
  stage 3. A layer *replicated* inside its TP group (Whale's replicate style) holds its full weights on
  every TP rank; they are sharded over the DP group like the others.
- **Activations** — per micro-batch, the bytes the rank's layers keep for backward (``LayerCost.act_bytes``,
  already reduced by recompute and sequence parallelism; Korthikanti et al. 2022 Table 2), times the
  micro-batches in flight for the schedule (:func:`planner.cost.pipeline.inflight_microbatches`), plus the
  *working set* of the backward of one layer: with full recompute, the re-materialised activations of the
  largest layer for one micro-batch (Korthikanti et al. §4.1 count it as one extra layer's worth).
- **Communication buffers** — DDP gradient buckets (2 x 25 MiB, torch DDP default ``bucket_cap_mb``),
  pipeline send and receive buffers (2 x the boundary activation per chunk), and under ZeRO-3 the
  un-sharded weights of the two largest layers in flight (current + prefetched, FSDP ``limit_all_gathers``).
- **Reserve** — CUDA context, cuBLAS and NCCL workspaces (``CUDA_CONTEXT_BYTES``, GPUs only) plus
  allocator fragmentation (``FRAGMENTATION_FRACTION`` of everything above). See ``constants.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.cost.constants import (
    CUDA_CONTEXT_BYTES,
    FRAGMENTATION_FRACTION,
    OPTIMIZER_BYTES_PER_PARAM,
    STATE_BYTES_PER_PARAM,
    TORCH_ADAMW_BYTES_PER_PARAM,
)
from planner.errors import StratagemError


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelStates:
    """Bytes of weights, gradients and optimizer state on one rank."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBreakdown:
    """Peak memory of one rank, by term, in bytes; ``capacity_bytes`` is the device's memory."""

    params: float
    grads: float
    optimizer: float
    activations: float
    comm_buffers: float
    reserve: float
    capacity: float
    expert_states: float = 0.0  # MoE: routed experts' weights, gradients, optimizer states (planner.cost.moe)

    @property
    def peak_bytes(self) -> float:
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.expert_states
            + self.activations
            + self.comm_buffers
            + self.reserve
        )

    def as_dict(self) -> dict[str, float]:
        """Bytes by term (``expert_states`` only for Mixture-of-Experts ranks that hold experts)."""
        out = {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "comm_buffers": self.comm_buffers,
            "reserve": self.reserve,
            "capacity": self.capacity,
        }
        if self.expert_states:
            out["expert_states"] = self.expert_states
        return out


def precision_kind(dtype: str) -> str:
    """``'mixed'`` for 16/8-bit compute (fp32 master weights), ``'fp32'`` for fp32/tf32."""
    return "fp32" if dtype in ("fp32", "tf32") else "mixed"


def state_dtype(dtype: str, precision: str = "pure") -> str:
    """The dtype whose weight, gradient and optimizer bytes (``STATE_BYTES_PER_PARAM``) and gradient and weight
    collectives apply: ``dtype``, or fp32 under torch.autocast (``ModelProfile.precision == "autocast"``:
    Stratagem's runtime keeps fp32 weights, fp32 gradients and fp32 AdamW moments, 4 + 4 + 8 bytes, and its
    FSDP2 wrappers, given no mixed-precision policy, all-reduce, reduce-scatter and all-gather them in fp32).

    >>> state_dtype("bf16"), state_dtype("bf16", "autocast")
    ('bf16', 'fp32')
    """
    return "fp32" if precision == "autocast" else dtype


def optimizer_bytes_per_param(precision: str = "pure") -> float:
    """HBM bytes one AdamW step moves per parameter: Megatron's fused step (``OPTIMIZER_BYTES_PER_PARAM``), or
    torch's foreach AdamW on fp32 weights under autocast (``TORCH_ADAMW_BYTES_PER_PARAM``)."""
    return TORCH_ADAMW_BYTES_PER_PARAM if precision == "autocast" else OPTIMIZER_BYTES_PER_PARAM


def model_states_bytes(params_per_rank: float, zero_stage: int, dp: int, dtype: str = "bf16") -> ModelStates:
    """Weights, gradients and AdamW state of ``params_per_rank`` parameters under ZeRO ``zero_stage``.

    ZeRO paper (Rajbhandari et al. 2020) §5.1/Figure 1: with Psi parameters and N_d data-parallel ranks,
    stage 0 holds (2 + 2 + 12) Psi bytes, stage 1 (2 + 2) Psi + 12 Psi/N_d, stage 2 2 Psi + 14 Psi/N_d,
    stage 3 16 Psi/N_d.

    >>> model_states_bytes(1e9, 0, 8).total_bytes
    16000000000.0
    >>> model_states_bytes(1e9, 3, 8).total_bytes
    2000000000.0
    """
    if zero_stage not in (0, 1, 2, 3):
        raise StratagemError(f"ZeRO stage {zero_stage} does not exist; use 0, 1, 2 or 3")
    if dp < 1:
        raise StratagemError(f"data-parallel degree must be >= 1, got {dp}")
    per = STATE_BYTES_PER_PARAM[precision_kind(dtype)]
    return ModelStates(
        params_bytes=params_per_rank * per["params"] / (dp if zero_stage >= 3 else 1),
        grads_bytes=params_per_rank * per["grads"] / (dp if zero_stage >= 2 else 1),
        optimizer_bytes=params_per_rank * per["optimizer"] / (dp if zero_stage >= 1 else 1),
    )


def reserve_bytes(allocated_bytes: float, *, is_gpu: bool) -> float:
    """Framework reserve: CUDA context on GPUs plus allocator fragmentation (see ``constants.py``)."""
    return (CUDA_CONTEXT_BYTES if is_gpu else 0.0) + FRAGMENTATION_FRACTION * allocated_bytes


def build_memory_breakdown(
    *,
    states: list[ModelStates],
    act_bytes_per_microbatch: float,
    inflight_microbatches: float,
    working_set_bytes: float,
    comm_buffer_bytes: float,
    capacity_bytes: float,
    is_gpu: bool,
    expert_state_bytes: float = 0.0,
) -> MemoryBreakdown:
    """Assemble one rank's peak memory from its parts (formulae in the module docstring)."""
    params = sum(s.params_bytes for s in states)
    grads = sum(s.grads_bytes for s in states)
    optimizer = sum(s.optimizer_bytes for s in states)
    activations = act_bytes_per_microbatch * inflight_microbatches + working_set_bytes
    allocated = params + grads + optimizer + expert_state_bytes + activations + comm_buffer_bytes
    return MemoryBreakdown(
        expert_states=expert_state_bytes,
        params=params,
        grads=grads,
        optimizer=optimizer,
        activations=activations,
        comm_buffers=comm_buffer_bytes,
        reserve=reserve_bytes(allocated, is_gpu=is_gpu),
        capacity=capacity_bytes,
    )
