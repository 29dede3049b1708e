"""Peak memory of one rank as `stratagem launch` holds it: model states, the peak moment's activations and
gradients, the backward's working set, buffers, reserve.

Each term is reported separately (``MemoryBreakdown``); the terms follow the runtime (``runtime.executor.fsdp``,
``schedule``), checked against its measured live tensor bytes by ``benchmarks/memory_accuracy.py``:

- **Model states** (:func:`runtime_states`): 16-bit weights and gradients with fp32 master weights and AdamW
  moments, 2 + 2 + 12 bytes per parameter (fp32 training: 4 + 4 + 8; under torch.autocast fp32 weights and
  gradients, :func:`state_dtype`). Data parallelism is FSDP2: ``replicate`` at ZeRO-0, ``fully_shard`` at ZeRO
  1-3 (ZeRO-1 runs as ZeRO-2, so it is priced as ZeRO-2). From ZeRO-1 on, weights at rest and AdamW state are
  sharded over the data-parallel group (FSDP2 shards weights between steps at every stage). FSDP2 gathers the
  weights for the forward into an unsharded copy (``unsharded``): below ZeRO-3 it keeps all of them until the
  backward ends (``replicate`` too, on one rank's full weights), at ZeRO-3 the root unit and the block whose
  backward runs (the backward sweep below).
- **The peak moment** (:func:`peak_moments`): a rank peaks during one of its backwards or as the last one
  ends. During a backward it holds the activations of the other micro-batches in flight (``LayerCost.act_bytes``,
  already reduced by recompute and sequence parallelism; :func:`planner.cost.pipeline.inflight_microbatches`),
  the outputs torch pipelining keeps per micro-batch, and the backward sweep below; from its second backward on,
  the gradients accumulated so far (unsharded below ZeRO-3: the runtime reduces on the last micro-batch only).
  As the last backward ends: the gradients alone. The estimate takes the moment that needs most.
- **The backward sweep** (``estimate._Assembler._backward_sweep``): the backward runs the rank's layers last to
  first and frees each layer's saved activations as it ends, so as it reaches a layer, that layer's and the
  earlier layers' activations are alive, with the layer's working set — the gradients it receives and makes
  (measured per layer: ``ShardProfile.backward_ws_bytes_per_sample``), the activations full recompute
  re-materialises, an MoE block's dispatch buffers — and, in the first backward, the gradients the later layers
  have made. A block is its own FSDP2 unit (ZeRO 1-3, :func:`block_unit_bytes`): as its backward ends it also
  holds the copy of its gradients it reduce-scatters from and, at ZeRO-3, its gathered weights; the other
  layers form the root unit, which at ZeRO-3 stays gathered from the forward to the end of the backward (FSDP2
  does not reshard the root after the forward). The sweep is taken per run of identical consecutive layers
  (the search's groups): at the run's last layer (all its activations) and at its first (one layer's
  activations, the run's gradients), each with the run's largest working set, so the exact search prices the
  same figure with linear rows (``planner.search.ilp``). A rank of several chunks (interleaved schedules) is
  priced with all its activations alive at its largest working set.
- **Communication buffers**: torch pipelining's receive buffers, one per micro-batch and direction
  (``estimate._Assembler._pipeline_bytes``). FSDP2 reduces gradients in place, so there are no DDP bucket copies.
- **Reserve** — CUDA context, cuBLAS and NCCL workspaces (``CUDA_CONTEXT_BYTES``, GPUs only) plus
  allocator fragmentation (``FRAGMENTATION_FRACTION`` of everything above). See ``constants.py``.

Not modelled (measured gaps, ``benchmarks/memory_accuracy.py``): the order of layers inside a run and across
the chunks of an interleaved rank, the exchange buffers of context parallelism, routing imbalance at ep = 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.core import (
    CUDA_CONTEXT_BYTES,
    FRAGMENTATION_FRACTION,
    OPTIMIZER_BYTES_PER_PARAM,
    STATE_BYTES_PER_PARAM,
    TORCH_ADAMW_BYTES_PER_PARAM,
    StratagemError,
)


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
    # the data-parallel wrapper's gathered (unsharded) weights: all of them below ZeRO-3, the layers in flight at 3
    unsharded: float = 0.0

    @property
    def peak_bytes(self) -> float:
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.expert_states
            + self.unsharded
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
        if self.unsharded:
            out["unsharded_params"] = self.unsharded
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


@dataclass(frozen=True, kw_only=True, slots=True)
class Moment:
    """One candidate for the time of a rank's peak: the micro-batches whose activations are alive then
    (``inflight``) and which gradients exist (``grads``: "none" before the rank's first backward, "accumulating"
    in a later one, "end" as its last backward ends)."""

    inflight: float
    grads: str


def peak_moments(schedule: str, pp: int, m: int, inflight: float) -> tuple[Moment, ...]:
    """The candidate peak times of a pp rank holding ``inflight`` micro-batches at most (the runtime's schedules).

    - pp = 1 (one micro-batch at a time, gradients accumulated): each backward starts with one micro-batch's
      activations; from the second on, the accumulated gradients are alive too.
    - GPipe: the first backward starts with all ``m`` forwards' activations and no gradient; the second with
      ``m - 1`` and the gradients.
    - 1F1B (and interleaved): ``inflight`` at the first backward, and again at a later one when ``m`` exceeds it
      (steady state; else one fewer), now with gradients.
    - Always: the end of the last backward, no activations left, the gradients.

    >>> [(x.inflight, x.grads) for x in peak_moments("gpipe", 2, 4, 4.0)]
    [(4.0, 'none'), (3.0, 'accumulating'), (0.0, 'end')]
    >>> [(x.inflight, x.grads) for x in peak_moments("1f1b", 1, 1, 1.0)]
    [(1.0, 'none'), (0.0, 'end')]
    """
    out = [Moment(inflight=1.0 if pp == 1 else inflight, grads="none")]
    if m > 1:
        if pp == 1:
            later = 1.0
        elif schedule == "gpipe":
            later = float(m - 1)
        elif schedule == "1f1b":
            later = inflight if m > inflight else inflight - 1.0
        else:
            later = inflight
        out.append(Moment(inflight=later, grads="accumulating"))
    out.append(Moment(inflight=0.0, grads="end"))
    return tuple(out)


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeStates:
    """Per parameter, the bytes one rank holds under the runtime's data parallelism (``runtime.executor.fsdp``:
    FSDP2 ``replicate`` at ZeRO-0, ``fully_shard`` at ZeRO 1-3), over a data-parallel group of ``dp`` ranks.

    - ``always``: weights at rest (sharded over dp at ZeRO >= 1: FSDP2 shards them between steps at every stage)
      and AdamW state (sharded at ZeRO >= 1), plus, with dp > 1 below ZeRO-3, the unsharded copy of the weights
      FSDP2 gathers for the forward and keeps until the backward ends (at ZeRO-3: the layers in flight, priced
      apart).
    - ``accumulating``: gradients while micro-batches accumulate (unsharded: the runtime syncs on the last
      micro-batch only; at ZeRO-3 reduce-scattered each micro-batch, so sharded).
    - ``end``: gradients as the last backward ends: reduced in place at ZeRO-0 (``replicate``'s one unit),
      reduce-scattered unit by unit at ZeRO 1-3, so only the shards are left.
    ZeRO-1 runs as ZeRO-2 (``runtime.executor.fsdp``), so it is priced as ZeRO-2.

    >>> s = runtime_states(0, 2, "fp32")
    >>> s.always, s.unsharded, s.accumulating, s.end  # fp32 weights 4 + AdamW 8 + the gathered copy 4
    (16.0, 4.0, 4.0, 4.0)
    >>> runtime_states(3, 4, "fp32").always
    3.0
    """

    always: float
    unsharded: float
    accumulating: float
    end: float

    def grads(self, mode: str) -> float:
        return {"none": 0.0, "accumulating": self.accumulating, "end": self.end}[mode]


def runtime_states(zero_stage: int, dp: int, dtype: str = "bf16") -> RuntimeStates:
    """:class:`RuntimeStates` of ZeRO ``zero_stage`` over ``dp`` data-parallel ranks."""
    if zero_stage not in (0, 1, 2, 3):
        raise StratagemError(f"ZeRO stage {zero_stage} does not exist; use 0, 1, 2 or 3")
    if dp < 1:
        raise StratagemError(f"data-parallel degree must be >= 1, got {dp}")
    per = STATE_BYTES_PER_PARAM[precision_kind(dtype)]
    shard = dp if zero_stage >= 1 else 1
    unsharded = float(per["params"]) if dp > 1 and zero_stage < 3 else 0.0
    accumulating = per["grads"] / dp if zero_stage == 3 else float(per["grads"])
    end = per["grads"] / shard
    return RuntimeStates(
        always=per["params"] / shard + per["optimizer"] / shard + unsharded,
        unsharded=unsharded,
        accumulating=accumulating,
        end=end,
    )


def expert_runtime_states(zero_stage: int, edp: int, dtype: str = "bf16") -> RuntimeStates:
    """:class:`RuntimeStates` of the routed experts over their ``edp`` expert-data-parallel ranks as the runtime
    holds them (``runtime.executor.moe.apply_expert_dp``).

    - ZeRO-0, or one edp rank: plain parameters outside any wrapper (their gradients all-reduced after the
      backward): whole weights, AdamW state and gradients, no gathered copy.
    - ZeRO >= 1: each expert a ``fully_shard`` unit over edp with ``reshard_after_forward=False``: sharded at
      rest, the gathered copy alive from the forward to the end of the backward at every stage (ZeRO-3 too);
      gradients as the dense ones (:func:`runtime_states`).

    >>> e = expert_runtime_states(3, 2, "fp32")
    >>> e.always, e.unsharded, e.accumulating, e.end  # 4/2 + 8/2 + the gathered copy 4; grads 4/2
    (10.0, 4.0, 2.0, 2.0)
    >>> expert_runtime_states(1, 1, "fp32").always
    12.0
    """
    per = STATE_BYTES_PER_PARAM[precision_kind(dtype)]
    if zero_stage == 0 or edp == 1:
        return RuntimeStates(
            always=float(per["params"] + per["optimizer"]),
            unsharded=0.0,
            accumulating=float(per["grads"]),
            end=float(per["grads"]),
        )
    dense = runtime_states(zero_stage, edp, dtype)
    gathered = float(per["params"])
    return RuntimeStates(
        always=dense.always - dense.unsharded + gathered,
        unsharded=gathered,
        accumulating=dense.accumulating,
        end=dense.end,
    )


def block_unit_bytes(
    zero_stage: int, dp: int, kind: str, params: float, param_bytes: float, grad_bytes: float
) -> tuple[float, float]:
    """(weights, gradients) a block, its own FSDP2 unit (``fully_shard``, ZeRO 1-3 over dp > 1 ranks), adds to
    the backward sweep as its backward ends: at ZeRO-3 its gathered weights (``param_bytes``), and the copy of
    its gradients it reduce-scatters from (``params`` x ``grad_bytes``, kept until the next unit's
    reduce-scatter). Nothing for a layer of the root unit (``kind`` not ``"block"``) or below ZeRO-1.

    >>> block_unit_bytes(3, 2, "block", 100, 400, 4), block_unit_bytes(2, 2, "block", 100, 400, 4)
    ((400, 400), (0.0, 400))
    >>> block_unit_bytes(3, 2, "head", 100, 400, 4), block_unit_bytes(0, 2, "block", 100, 400, 4)
    ((0.0, 0.0), (0.0, 0.0))
    """
    if kind != "block" or zero_stage == 0 or dp == 1:
        return 0.0, 0.0
    return (param_bytes if zero_stage == 3 else 0.0), params * grad_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class SweepRun:
    """One run of identical consecutive layers on a rank, for :func:`backward_sweep`: its activations, the
    gradients its layers make (as the moment counts them), its largest working set (with the block unit), and
    one layer's activations less its gradients at the most (``first``; below 0 where a layer's gradients outweigh
    its activations, as under full recompute: the run's first layer has not made its own gradients yet)."""

    act: float
    grads: float
    ws: float
    first: float


def backward_sweep(runs: list[SweepRun]) -> tuple[float, int, float]:
    """The worst point of the backward sweep over ``runs`` (in model order): (bytes, index of its run or -1,
    the later layers' gradients counted there). At a run's last layer: the activations before and of the run,
    its working set, the later runs' gradients; at its first layer: ``first``, the working set, the run's and
    the later runs' gradients. One rule for the estimate and the search's tables.

    >>> backward_sweep([SweepRun(act=10, grads=4, ws=3, first=6), SweepRun(act=2, grads=1, ws=20, first=1)])
    (32.0, 1, 0.0)
    """
    after = sum((run.grads for run in runs), 0.0)
    before = 0.0
    best = (0.0, -1, 0.0)
    for i, run in enumerate(runs):
        after -= run.grads
        last_point = (before + run.act + run.ws + after, after)
        first_point = (before + run.first + run.ws + after + run.grads, after + run.grads)
        for total, grads in (last_point, first_point):
            if total > best[0]:
                best = (total, i, grads)
        before += run.act
    return best


def reserve_terms(*, is_gpu: bool) -> tuple[float, float]:
    """(factor, bytes) of the peak over the allocated bytes: ``peak = factor x allocated + bytes``, allocator
    fragmentation (``FRAGMENTATION_FRACTION``) and, on GPUs, the CUDA context (``CUDA_CONTEXT_BYTES``); the
    search's memory rows use these two numbers as they are."""
    return 1.0 + FRAGMENTATION_FRACTION, CUDA_CONTEXT_BYTES if is_gpu else 0.0


def reserve_bytes(allocated_bytes: float, *, is_gpu: bool) -> float:
    """Framework reserve: CUDA context on GPUs plus allocator fragmentation (:func:`reserve_terms`)."""
    return reserve_terms(is_gpu=is_gpu)[1] + FRAGMENTATION_FRACTION * allocated_bytes


def runtime_breakdown(
    *,
    params: float,
    optimizer: float,
    unsharded: float,
    grads: float,
    activations: float,
    comm_buffers: float,
    capacity_bytes: float,
    is_gpu: bool,
    expert_state_bytes: float = 0.0,
) -> MemoryBreakdown:
    """One rank's peak from the runtime's terms (``planner.cost.estimate``), with the reserve on top."""
    allocated = params + optimizer + unsharded + grads + activations + comm_buffers + expert_state_bytes
    return MemoryBreakdown(
        params=params,
        grads=grads,
        optimizer=optimizer,
        activations=activations,
        comm_buffers=comm_buffers,
        reserve=reserve_bytes(allocated, is_gpu=is_gpu),
        capacity=capacity_bytes,
        expert_states=expert_state_bytes,
        unsharded=unsharded,
    )


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
    return runtime_breakdown(
        params=sum(s.params_bytes for s in states),
        optimizer=sum(s.optimizer_bytes for s in states),
        unsharded=0.0,
        grads=sum(s.grads_bytes for s in states),
        activations=act_bytes_per_microbatch * inflight_microbatches + working_set_bytes,
        comm_buffers=comm_buffer_bytes,
        capacity_bytes=capacity_bytes,
        is_gpu=is_gpu,
        expert_state_bytes=expert_state_bytes,
    )
