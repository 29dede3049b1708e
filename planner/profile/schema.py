"""Profile schemas: what a model costs per layer, and what a cluster can do (the classes; loading, with the
migration of older files, is :mod:`planner.profile.load`, which re-exports them).

Two versioned JSON documents cross the boundary between measuring and planning:

- :class:`ModelProfile` — per layer (keyed by module path): FLOPs, parameter bytes, bytes saved for
  backward, output activation bytes, forward/backward times, and per tensor-parallel degree the shard's
  figures plus the collectives that layout needs.
- :class:`ClusterProfile` — node types (device, count per node, memory, compute throughput per dtype)
  and the alpha-beta fits of each collective per link level, with the raw samples behind them.

Units are in every field name (``_s``, ``_bytes``, ``_flops``, ``_per_s``). Every document carries a
``schema_version``, its :class:`Provenance`, and a ``content_hash`` over its contents.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveInt, field_validator, model_validator

from planner.core import MAX_MAGNITUDE, Dtype, Precision, save_document
from planner.model import ModelSpec

# The shipped cluster and model profiles: package data of ``planner`` (``planner/shipped_profiles`` links to the
# repository's ``profiles/`` folder; a wheel holds a copy), so an installed stratagem finds them from any folder.
SHIPPED_PROFILES_DIR = Path(__file__).resolve().parents[1] / "shipped_profiles"

MODEL_PROFILE_SCHEMA_VERSION: Final = 1
CLUSTER_PROFILE_SCHEMA_VERSION: Final = 2  # 2: NodeType.kernel_model, ClusterProfile.calibration (v1 migrates)

CollectiveOp = Literal["all_reduce", "all_gather", "reduce_scatter", "send_recv", "all_to_all"]
LinkLevel = Literal["intra_node", "inter_node"]
Origin = Literal["measured", "derived"]


class StrictModel(BaseModel):
    # No NaN or infinity anywhere in a file: "+Infinity" bandwidth or a NaN time would pass every bound.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _physical(cls, value: Any) -> Any:
        """Numbers beyond 1e24 (bytes, FLOPs, seconds, counts) are no physical value: the products the cost
        model forms with them would overflow to infinity."""
        for v in value if isinstance(value, list) else value.values() if isinstance(value, dict) else (value,):
            if isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) > MAX_MAGNITUDE:
                raise ValueError(f"{v:g} is beyond any physical value (|x| <= {MAX_MAGNITUDE:g})")
        return value


class Provenance(StrictModel):
    """How a document was made: measured or derived, when, with what, from which sources."""

    method: Literal["measured", "analytic", "datasheet", "mixed"]
    tool: str = Field(description="program and version that wrote the file, e.g. 'stratagem 0.1.0'")
    created_utc: str = Field(description="ISO-8601 UTC time the file was written")
    torch_version: str | None = None
    device_name: str | None = Field(None, description="device the numbers were measured on, if any")
    host: str | None = None
    command: str | None = Field(None, description="command line that produced the file")
    sources: list[str] = Field(default_factory=list, description="citations for derived numbers")
    notes: str = ""


# ---------------------------------------------------------------------------------------------
# Model profile
# ---------------------------------------------------------------------------------------------


class TimingStats(StrictModel):
    """Repeated timing of one measurement: median and spread, in seconds."""

    median_s: float = Field(ge=0)
    min_s: float = Field(ge=0)
    max_s: float = Field(ge=0)
    repeats: int = Field(ge=1)
    warmup: int = Field(ge=0)


class LayerTiming(StrictModel):
    """Forward/backward time of one layer (or its TP shard) at one micro-batch size."""

    micro_batch: int = Field(ge=1)
    forward: TimingStats
    backward: TimingStats


class CollectiveNeed(StrictModel):
    """A collective a layer's TP layout issues per micro-batch; bytes scale with the micro-batch."""

    op: CollectiveOp
    phase: Literal["forward", "backward"]
    axis: Literal["tp"] = "tp"
    bytes_per_sample: float = Field(ge=0, description="message size per sample, full (unsharded) tensor")
    count: int = Field(1, ge=1, description="how many such collectives per micro-batch")
    with_sequence_parallel: bool = Field(
        False, description="True: issued only with sequence parallelism; False: only without it"
    )


class OpProfile(StrictModel):
    """One kernel of a layer's forward pass on one TP rank (``planner.cost.kernels`` times it).

    ``gemm``: ``batch_per_sample`` independent ``m x n x k`` products per sample, ``m = rows_per_sample`` rows
    per sample (tokens for a linear layer, whose rows grow with the micro-batch; for batched attention GEMMs
    ``rows_per_sample`` is the sequence and ``batch_per_sample`` the heads). Its backward is two GEMMs (input
    gradient ``m x k x n``, weight or second-operand gradient ``k x n x m``).
    ``memory``: an element-wise kernel moving ``bytes_per_sample`` forward and ``backward_bytes_per_sample``
    in its backward (0: none), timed at HBM bandwidth.
    """

    name: str = Field(description="e.g. 'qkv', 'scores', 'softmax', 'fc1', 'layernorm1', 'cross_entropy'")
    kind: Literal["gemm", "memory"]
    rows_per_sample: int = Field(0, ge=0, description="GEMM m per sample")
    n: int = Field(0, ge=0)
    k: int = Field(0, ge=0)
    batch_per_sample: int = Field(1, ge=1, description="independent GEMMs per sample (attention heads)")
    scale: Literal["rows", "batch"] = Field(
        "rows", description="what grows with the samples: the rows (linear layers) or the batch of GEMMs (attention)"
    )
    kernels: int = Field(1, ge=1, description="kernels of a memory op's forward")
    bytes_per_sample: float = Field(0, ge=0, description="HBM bytes read + written forward (memory kernels)")
    backward_bytes_per_sample: float = Field(0, ge=0, description="HBM bytes of its backward kernel(s)")
    backward_kernels: int = Field(1, ge=0, description="kernels of a memory op's backward")
    backward_fixed_bytes: float = Field(
        0, ge=0, description="backward bytes independent of the samples (a dense embedding gradient)"
    )
    fixed_bytes: float = Field(
        0, ge=0, description="forward bytes independent of the samples (autocast's weight casts, a causal mask)"
    )
    replicated: bool = Field(
        False,
        description="runs on the full activation on every TP rank (LayerNorm, "
        "dropout-add); sequence parallelism divides it by tp",
    )
    attention_core: bool = Field(
        False,
        description="part of the s x s attention (scores, softmax, dropout, "
        "context): flash attention replaces these, selective "
        "recompute repeats them",
    )


class ShardProfile(StrictModel):
    """What one TP rank holds and computes for this layer at tensor-parallel degree ``tp``."""

    tp: int = Field(ge=1)
    params: int = Field(ge=0, description="parameters held by one rank")
    param_bytes: int = Field(ge=0)
    fwd_flops_per_sample: float = Field(ge=0)
    bwd_flops_per_sample: float = Field(ge=0)
    saved_bytes_per_sample: float = Field(
        ge=0, description="bytes autograd saves for backward on one rank, per sample, no sequence parallel"
    )
    saved_replicated_bytes_per_sample: float = Field(
        0,
        ge=0,
        description="part of saved_bytes that every TP rank holds in full (LayerNorm inputs, "
        "dropout masks); sequence parallelism divides it by tp",
    )
    saved_attention_scores_bytes_per_sample: float = Field(
        0,
        ge=0,
        description="part of saved_bytes that is seq x seq attention scores (softmax, its dropout); "
        "selective recompute and flash attention drop it",
    )
    attention_scores_flops_per_sample: float = Field(
        0,
        ge=0,
        description="part of fwd_flops that computes and applies the seq x seq scores (QK^T, "
        "probs x V); selective recompute repeats it in backward (0 = unknown/none)",
    )
    saved_fixed_bytes: float = Field(
        0,
        ge=0,
        description="bytes kept from forward to backward per micro-batch independent of its samples "
        "(the 16-bit weight copies torch.autocast caches and the GEMMs save; planner.profile.autocast)",
    )
    backward_ws_bytes_per_sample: float = Field(
        0,
        ge=0,
        description="the backward's peak of transient tensors beyond what the forward saved, per sample: the "
        "gradient it receives, activation gradients, not the weights' gradients (runtime.profiling.measure."
        "backward_working_set; 0 in profiles that predate it)",
    )
    logits_bytes_per_sample: float = Field(
        0,
        ge=0,
        description="the model's last layer only: its output before the loss, per sample on one rank (the logits; "
        "vocab-parallel at tp > 1). torch.distributed.pipelining computes the loss outside the last stage, so "
        "that stage keeps it for every micro-batch in flight (0 for other layers and in profiles that predate it)",
    )
    timings: list[LayerTiming] = Field(default_factory=list, description="measured times per micro-batch")
    ops: list[OpProfile] = Field(
        default_factory=list,
        description="the shard's forward kernels (empty: unknown; the cost model then uses the layer-level roofline)",
    )
    time_origin: Origin = "derived"
    flops_origin: Origin = "measured"
    memory_origin: Origin = "measured"


class RuntimeOverhead(StrictModel):
    """Host time ``stratagem launch``'s torch.distributed wrappers add to this layer (measured, one process).

    Forward/backward figures are per micro-batch (measured at ``micro_batch``; fixed costs, not scaled):
    the wrapped layer's median time minus the plain layer's on a one-rank gloo group, floored at 0
    (``runtime/profiling/overhead.py``). Optimizer figures are per optimizer step over the layer's
    full (tp=1) parameters. Collective wire time is not included (the cluster profile prices it).
    """

    micro_batch: int = Field(ge=1)
    tp_forward_s: float = Field(0, ge=0, description="DTensor tensor-parallel dispatch, forward")
    tp_backward_s: float = Field(0, ge=0, description="DTensor tensor-parallel dispatch, backward")
    replicate_forward_s: float = Field(
        0, ge=0, description="FSDP2 replicate (ZeRO-0 data parallel): this layer's marginal cost inside a unit"
    )
    replicate_backward_s: float = Field(0, ge=0)
    fully_shard_forward_s: float = Field(
        0, ge=0, description="FSDP2 fully_shard (ZeRO-1/2/3): this layer's marginal cost inside a unit"
    )
    fully_shard_backward_s: float = Field(0, ge=0)
    replicate_unit_forward_s: float = Field(0, ge=0, description="fixed cost of one replicate unit")
    replicate_unit_backward_s: float = Field(0, ge=0)
    fully_shard_unit_forward_s: float = Field(0, ge=0, description="fixed cost of one fully_shard unit")
    fully_shard_unit_backward_s: float = Field(0, ge=0)
    optimizer_step_s: float = Field(0, ge=0, description="AdamW step + zero_grad, plain tensor parameters")
    optimizer_step_dtensor_s: float = Field(0, ge=0, description="the same on DTensor parameters (TP or FSDP2)")


class ExpertProfile(StrictModel):
    """The routed experts of a Mixture-of-Experts block (``planner.profile.moe``; costed by ``planner.cost.moe``).

    The block's shards hold everything else (attention, router weights, shared experts, norms), split over
    the attention tp as usual; the routed experts are split over ep and etp instead
    (``planner.plan.ExpertLayout``).
    Each expert is a SwiGLU FFN ``hidden -> expert_ffn -> hidden`` (three ``hidden x expert_ffn`` matrices).
    """

    experts: int = Field(ge=1, description="routed experts E")
    top_k: int = Field(ge=1, description="experts each token is sent to")
    hidden: int = Field(ge=1, description="model width h (the tokens' size on the wire)")
    expert_ffn: int = Field(ge=1, description="hidden width of one routed expert")
    tokens_per_sample: int = Field(ge=1, description="tokens per sample (the sequence length)")
    capacity_factor: float | None = Field(
        None, gt=0, description="tokens per expert capped at cf * tokens * top_k / experts; None = dropless"
    )
    wrapped_at_ep1: bool = Field(
        False,
        description=(
            "true: without an expert layout (ep = etp = 1) the runtime keeps these experts as their block's own "
            "parameters, inside the data-parallel wrapper (transformers' fused experts); false: plain parameters "
            "outside it, as at any ep (the zoo's MoE)"
        ),
    )
    fused_saved_bytes_per_token: float | None = Field(
        None,
        ge=0,
        description=(
            "bytes the fused experts module saves for backward per token (its top_k rows together), measured on "
            "the module's own forward (runtime.profiling.experts); used where the runtime runs that module "
            "(wrapped_at_ep1, ep = etp = 1). None: the analytic SwiGLU count of planner.cost.moe"
        ),
    )
    fused_backward_bytes_per_weight_byte: float | None = Field(
        None,
        ge=0,
        description=(
            "how far the fused experts module's backward grows the live bytes (its weights' gradients left out), "
            "per byte of its weights, measured (runtime.profiling.experts); priced where that module runs. None: "
            "the exchange's buffers of planner.cost.moe"
        ),
    )

    @property
    def params(self) -> int:
        """Parameters of all routed experts: E x 3 h f (gate, up, down)."""
        return self.experts * 3 * self.hidden * self.expert_ffn


class LayerProfile(StrictModel):
    """One top-level layer of the model (a block, an embedding, a head), keyed by module path."""

    path: str = Field(description="module path, e.g. 'blocks.3'")
    kind: str = Field(description="embedding | block | norm | head | stem | stage | pool | classifier | linear")
    signature: str = Field(description="layers with equal signatures are identical (aggregated by the ILP)")
    tp_style: Literal["none", "megatron_block", "vocab_parallel", "column", "row"] = "none"
    input_bytes_per_sample: float = Field(ge=0, description="activation received from the previous layer")
    output_bytes_per_sample: float = Field(ge=0, description="activation sent to the next layer")
    shards: list[ShardProfile] = Field(min_length=1, description="tp=1 first, then each profiled degree")
    collectives: list[CollectiveNeed] = Field(default_factory=list, description="needs at tp>1")
    runtime_overhead: RuntimeOverhead | None = Field(
        None, description="measured host overhead of the runtime's wrappers (None: not measured, e.g. analytic)"
    )
    experts: ExpertProfile | None = Field(
        None, description="routed experts of a Mixture-of-Experts block (None: dense layer)"
    )

    def shard(self, tp: int) -> ShardProfile:
        """The profiled shard at degree ``tp`` (KeyError if that degree was not profiled)."""
        for s in self.shards:
            if s.tp == tp:
                return s
        raise KeyError(f"layer {self.path} has no profile at tp={tp}")

    @property
    def params(self) -> int:
        """Parameters of the tp=1 shard (routed experts excluded: see :attr:`total_params`)."""
        return self.shards[0].params

    @property
    def total_params(self) -> int:
        """All the layer's parameters, routed experts included."""
        return self.params + (self.experts.params if self.experts is not None else 0)


def _check_signatures(layers: list[LayerProfile]) -> None:
    """Layers with equal signatures must be equal but for their path: the search prices one for all of them
    (an edited or torn profile that breaks this would get plans priced from the wrong layer)."""
    first: dict[str, tuple[str, dict]] = {}
    for layer in layers:
        body = layer.model_dump(exclude={"path"})
        seen = first.setdefault(layer.signature, (layer.path, body))
        if seen[1] != body:
            field = next(k for k in body if body[k] != seen[1].get(k))
            raise ValueError(
                f"layers {seen[0]} and {layer.path} share signature {layer.signature!r} but differ in {field}; "
                "re-profile the model (equal signatures mean identical layers)"
            )


class ModelProfile(StrictModel):
    """Per-layer costs of one model at one sequence length and dtype."""

    schema_version: Literal[1] = MODEL_PROFILE_SCHEMA_VERSION
    name: str
    model: ModelSpec
    seq_len: int = Field(ge=1, description="tokens per sample (1 for non-sequence models)")
    dtype: Dtype
    precision: Precision = Field(
        "pure",
        description="how 16-bit compute runs: 'pure' 16-bit weights and activations (Megatron-LM, torchtitan) "
        "or 'autocast' (fp32 weights under torch.autocast, Stratagem's runtime; planner.profile.autocast)",
    )
    sample_shape: list[int] = Field(description="input shape of one sample")
    micro_batches: list[PositiveInt] = Field(description="micro-batch sizes that were timed")
    tp_degrees: list[PositiveInt] = Field(min_length=1, description="tensor-parallel degrees that were profiled")
    total_params: int = Field(ge=0)
    layers: list[LayerProfile] = Field(min_length=1)
    reference_matmul: "ComputeFigure | None" = Field(
        None,
        description="the cluster profiler's matmul benchmark run in the model profiler's process while "
        "it timed the layers: relates these timings to a cluster profile's compute figure",
    )
    provenance: Provenance
    content_hash: str | None = None

    @model_validator(mode="after")
    def _check(self) -> "ModelProfile":
        paths = [layer.path for layer in self.layers]
        if len(set(paths)) != len(paths):
            raise ValueError("duplicate layer paths")
        if self.layers and sum(layer.total_params for layer in self.layers) != self.total_params:
            raise ValueError("total_params is not the sum of the layers' tp=1 params (routed experts included)")
        for layer in self.layers:
            if layer.shards[0].tp != 1:
                raise ValueError(f"layer {layer.path}: the first shard must be tp=1")
        _check_signatures(self.layers)
        return self

    def layer(self, path: str) -> LayerProfile:
        for layer in self.layers:
            if layer.path == path:
                return layer
        raise KeyError(path)


# ---------------------------------------------------------------------------------------------
# Cluster profile
# ---------------------------------------------------------------------------------------------


class CollectiveSample(StrictModel):
    """Raw timings of one collective at one message size (every repeat kept)."""

    bytes: int = Field(ge=0)
    times_s: list[NonNegativeFloat] = Field(min_length=1)


class CollectiveFit(StrictModel):
    """time(bytes) = alpha_s + bus_factor(op, n) * bytes / bus_bw_bytes_per_s on one link level.

    ``bus_factor`` is NCCL-tests' bus-bandwidth convention: 2(n-1)/n for all-reduce, (n-1)/n for
    all-gather and reduce-scatter (message = the full output), 1 for send/recv. With it, one bandwidth
    describes a link whatever the rank count (nccl-tests doc/PERFORMANCE.md).
    """

    op: CollectiveOp
    level: LinkLevel
    n_ranks: int = Field(ge=2, description="ranks the fit was measured or quoted with")
    alpha_s: float = Field(ge=0, description="latency per collective")
    bus_bw_bytes_per_s: float = Field(gt=0)
    origin: Origin
    source: str = Field(description="how measured, or the citation for a quoted figure")
    fit_r2: float | None = Field(None, description="coefficient of determination of the fit")
    fit_max_rel_err: float | None = Field(None, description="largest |fit-median|/median over sizes")
    run_cv: float | None = Field(None, description="median coefficient of variation across repeats")
    samples: list[CollectiveSample] = Field(default_factory=list)


class ComputeFigure(StrictModel):
    """Throughput of dense matrix multiply in one dtype."""

    dtype: Dtype
    peak_flops_per_s: float = Field(gt=0, description="datasheet peak, or the measured best")
    achieved_flops_per_s: float = Field(gt=0, description="what large GEMMs reach in practice")
    origin: Origin
    source: str


class TileShape(StrictModel):
    """One GEMM output tile shape the library picks from, and the fraction of the ceiling it reaches."""

    m: int = Field(ge=1)
    n: int = Field(ge=1)
    relative_efficiency: float = Field(gt=0, le=1)


class KernelModel(StrictModel):
    """Per-kernel performance parameters of one device type (``planner.cost.kernels``), each with its source.

    A GEMM runs in waves of ``sm_count`` output tiles at ``gemm_ceiling`` x dense peak (tile and wave
    quantization), or at HBM speed when its arithmetic intensity is below the ridge; element-wise kernels
    move bytes at ``memory_bw_efficiency`` x the datasheet bandwidth; every kernel adds ``kernel_gap_s`` on
    the device and costs ``host_op_s`` to issue (the layer is launch-bound when issuing takes longer).
    """

    sm_count: int = Field(ge=1, description="streaming multiprocessors (tiles run per wave)")
    tile_shapes: list[TileShape] = Field(min_length=1)
    gemm_ceiling: float = Field(gt=0, le=1, description="fraction of dense peak a large, well-shaped GEMM reaches")
    memory_bw_efficiency: float = Field(gt=0, le=1, description="fraction of datasheet HBM bandwidth streamed")
    kernel_gap_s: float = Field(ge=0, description="device idle time between dependent kernels")
    host_op_s: float = Field(ge=0, description="host time to issue one operator (framework + launch)")
    flash_attention_efficiency: float = Field(gt=0, le=1, description="fraction of dense peak of fused attention")
    comm_compute_contention: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="fraction of an overlapped collective's time that still costs compute time (SMs and HBM it takes)",
    )
    unaligned_gemm_efficiency: float | None = Field(
        None,
        gt=0,
        le=1,
        description="a GEMM whose n or k (the row-major operands' leading dimensions) is not a multiple of 16 "
        "bytes runs at this fraction of an aligned one's arithmetic rate; None: no penalty known for this device",
    )
    sources: dict[str, str] = Field(description="parameter name -> citation or how it was fitted")


class BlockingLatency(StrictModel):
    """Per-call latency of a collective that the rank waits on right after compute (CPU/gloo ranks).

    The alpha of a :class:`CollectiveFit` is timed back to back, every rank already waiting. In a training
    step on ranks whose cores are shared, a collective follows compute: the first rank there sleeps in
    gloo and runs again only when the scheduler gives it a core, so a call costs far more than that alpha
    (``runtime/profiling/sync_latency.py``, 2 gloo ranks on this repo's 2-vCPU host: ~0.7 ms plain, ~1.5 ms
    through DTensor's functional collectives, vs a back-to-back alpha of 0.19 ms). The cost model charges
    it per TP collective (``planner.cost.compute``): a split layer's collectives are DTensor's, waited on
    as soon as they are issued; and, where ``plain_collective_s`` was measured, per ZeRO-3 all-gather and
    reduce-scatter call (``planner.cost.zero3``: FSDP2 issues them as plain c10d calls and waits on them).
    None (GPU profiles): the fits' alpha applies.
    """

    functional_collective_s: float = Field(
        ge=0, description="per-call latency of a DTensor (functional) collective of 1 KiB after compute"
    )
    plain_collective_s: float | None = Field(
        None,
        ge=0,
        description="per-call latency of a plain c10d all-gather / reduce-scatter of 1 KiB after compute (FSDP2's "
        "ZeRO-3 collectives, planner.cost.zero3); None: not measured, the fits' alpha applies to them",
    )
    source: str


class NodePower(StrictModel):
    """What a node draws while it trains, for energy estimates (``stratagem frontier``).

    Per device: ``idle_w + (board_w - idle_w) x u`` with ``u`` the plan's predicted utilisation (the linear
    power model of Fan, Weber & Barroso, "Power provisioning for a warehouse-sized computer", ISCA 2007); per
    node ``host_w`` more (CPUs, NICs, switches, fans); the facility ``pue`` times that (power usage
    effectiveness: cooling and power delivery).
    """

    board_w: float = Field(gt=0, description="one device's board power (TDP) at full load, watts")
    idle_w: float = Field(ge=0, description="one device's power with memory held and no kernels running, watts")
    host_w: float = Field(ge=0, description="the node's power beside its devices at load, watts")
    pue: float = Field(ge=1, description="facility power usage effectiveness (total / IT power)")
    source: str

    @model_validator(mode="after")
    def _check(self) -> "NodePower":
        if self.idle_w > self.board_w:
            raise ValueError(f"idle_w {self.idle_w} exceeds board_w {self.board_w}")
        return self


class NodeType(StrictModel):
    """One kind of node: its devices and what links them."""

    name: str = Field(description="short id used by node groups, e.g. 'dgx-a100-80g'")
    device: str = Field(description="device model, e.g. 'NVIDIA A100-SXM4-80GB' or 'cpu'")
    devices_per_node: int = Field(ge=1)
    device_memory_bytes: int = Field(gt=0)
    device_memory_source: str
    memory_bw_bytes_per_s: float | None = Field(None, description="device memory bandwidth")
    compute: list[ComputeFigure] = Field(min_length=1)
    intra_node: list[CollectiveFit] = Field(default_factory=list, description="fits inside one node")
    nic_bw_bytes_per_s: float | None = Field(None, description="injection bandwidth per node, all NICs")
    nic_source: str | None = None
    kernel_model: KernelModel | None = Field(
        None, description="per-kernel model (GPUs); None: the layer-level roofline on achieved_flops_per_s"
    )
    blocking_latency: BlockingLatency | None = Field(
        None, description="collective latency after compute (measured on CPU ranks); None: the fits' alpha"
    )
    power: NodePower | None = Field(None, description="power draw for energy estimates; None: energy not estimated")
    price_per_gpu_hour: float | None = Field(
        None, gt=0, description="US dollars per device-hour (shipped profiles: an on-demand list price)"
    )
    price_source: str | None = Field(None, description="where the price comes from, its kind and date")

    def compute_for(self, dtype: str) -> ComputeFigure:
        for c in self.compute:
            if c.dtype == dtype:
                return c
        raise KeyError(f"node type {self.name} has no compute figure for {dtype}")

    def has_dtype(self, dtype: str) -> bool:
        return any(c.dtype == dtype for c in self.compute)


class NodeGroup(StrictModel):
    """``count`` nodes of one node type."""

    node_type: str
    count: int = Field(ge=1)


class FabricLoad(StrictModel):
    """Share of the inter-node fits' bus bandwidth a job gets when all of its nodes communicate at once.

    The inter-node fits come from nccl-tests on a few nodes, where no other traffic crosses the switches. On a
    statically routed fat tree the flows of a job's many nodes share upper-level links, and the effective
    bandwidth falls with the job's size (Hoefler, Schneider & Lumsdaine, "Multistage Switches are not
    Crossbars", IEEE Cluster 2008: 55-60 % of full bisection bandwidth on large clusters). ``points`` are
    measured ``(nodes, fraction)`` pairs of one cluster; between them the fraction is linear in
    ``log(nodes)``, outside them it stays at the nearest point's value. The cost model applies
    ``fraction(job nodes)`` to every inter-node fit (``planner.cost.collectives``, ``planner.cost.moe``); the job's
    nodes are the cluster's as ``planner.cost.placement.with_gpus`` sizes it to the plan (a mixed cluster is not
    resized: all of its nodes count). None: no such loss.
    """

    points: list[tuple[int, float]] = Field(
        min_length=1, description="(job nodes, fraction of the fits' bus bandwidth), nodes increasing"
    )
    source: str

    @model_validator(mode="after")
    def _check(self) -> "FabricLoad":
        nodes = [n for n, _ in self.points]
        if any(n < 1 for n in nodes) or any(b <= a for a, b in zip(nodes, nodes[1:])):
            raise ValueError("fabric_load points need node counts >= 1 in increasing order")
        if any(not 0 < f <= 1 for _, f in self.points):
            raise ValueError("fabric_load fractions must lie in (0, 1]")
        return self

    def fraction(self, nodes: int) -> float:
        """The fraction at a job of ``nodes`` nodes.

        >>> round(FabricLoad(points=[(2, 1.0), (384, 0.37)], source="").fraction(2240 // 8), 3)
        0.408
        """
        pts = self.points
        if nodes <= pts[0][0]:
            return pts[0][1]
        for (n0, f0), (n1, f1) in zip(pts, pts[1:]):
            if nodes <= n1:
                return f0 + (f1 - f0) * math.log(nodes / n0) / math.log(n1 / n0)
        return pts[-1][1]


class Calibration(StrictModel):
    """What ``stratagem calibrate`` fitted this profile's parameters on, and how well they predict."""

    runs_hash: str = Field(description="sha256 of the measured runs' canonical JSON")
    runs: int = Field(ge=1, description="number of measured runs fitted")
    fitted: dict[str, float] = Field(description="parameter -> fitted value")
    prior: dict[str, float] = Field(description="parameter -> value before calibration")
    cv_mean_abs_error: float | None = Field(None, ge=0, description="k-fold cross-validated mean |error|")
    mean_abs_error_before: float = Field(ge=0)
    mean_abs_error_after: float = Field(ge=0)
    created_utc: str
    note: str = ""


class ClusterProfile(StrictModel):
    """A cluster: groups of nodes by type (mixed clusters allowed) and the network between nodes."""

    schema_version: Literal[2] = CLUSTER_PROFILE_SCHEMA_VERSION
    name: str
    description: str = ""
    node_types: list[NodeType] = Field(min_length=1)
    nodes: list[NodeGroup] = Field(min_length=1)
    inter_node: list[CollectiveFit] = Field(default_factory=list, description="fits across nodes")
    fabric_load: FabricLoad | None = Field(
        None, description="bandwidth share of large jobs on a shared fabric (FabricLoad); None: the fits as measured"
    )
    calibration: Calibration | None = Field(None, description="set by `stratagem calibrate`")
    provenance: Provenance
    content_hash: str | None = None

    @model_validator(mode="after")
    def _check(self) -> "ClusterProfile":
        names = {nt.name for nt in self.node_types}
        for group in self.nodes:
            if group.node_type not in names:
                raise ValueError(f"node group refers to unknown node type {group.node_type!r}")
        return self

    def node_type(self, name: str) -> NodeType:
        for nt in self.node_types:
            if nt.name == name:
                return nt
        raise KeyError(name)

    def calibration_note(self) -> str:
        """One line saying the profile is calibrated (runs, CV error, date), or "" when it is not."""
        c = self.calibration
        if c is None:
            return ""
        cv = f", cross-validated error {c.cv_mean_abs_error:.1%}" if c.cv_mean_abs_error is not None else ""
        return f"calibrated on {c.runs} measured runs{cv} ({c.created_utc[:10]})"

    @property
    def total_nodes(self) -> int:
        return sum(g.count for g in self.nodes)

    def inter_node_fraction(self) -> float:
        """Share of the inter-node fits' bus bandwidth at this cluster's size (:class:`FabricLoad`; 1 without)."""
        return 1.0 if self.fabric_load is None else self.fabric_load.fraction(self.total_nodes)

    def fabric_note(self) -> str:
        """One line naming the fabric load at this cluster's size, or "" without one."""
        if self.fabric_load is None:
            return ""
        return (
            f"fabric load: inter-node bandwidth x{self.inter_node_fraction():.2f} at {self.total_nodes} nodes "
            f"({self.fabric_load.source})"
        )

    @property
    def total_devices(self) -> int:
        return sum(g.count * self.node_type(g.node_type).devices_per_node for g in self.nodes)

    @property
    def is_inventory(self) -> bool:
        """True for a measured profile: it describes the machines it ran on, so planning for more devices
        would plan for hardware that does not exist. Datasheet and analytic profiles are templates (a node
        type and its network) that ``--gpus`` resizes."""
        return self.provenance.method == "measured"

    @property
    def is_mixed(self) -> bool:
        return len({g.node_type for g in self.nodes}) > 1


# ---------------------------------------------------------------------------------------------
# I/O
# ---------------------------------------------------------------------------------------------

# Shipped profiles: data beside the schemas that load them.
PROFILES_DIR = SHIPPED_PROFILES_DIR  # package data: found from any folder, installed or not


DTYPE_HELP = (
    "compute dtype (default: bf16 where every device used has a bf16 figure, else fp16, else one they all have; "
    "measured CPU profiles: fp32)"
)
PRECISION_HELP = (
    "how 16-bit compute runs (closed-form GPT profiles): 'pure' 16-bit weights and activations as Megatron-LM, "
    "torchtitan and `stratagem launch` (compiled blocks or FSDP2's bf16 policy) train (default), or 'autocast', "
    "fp32 weights under eager torch.autocast as `stratagem launch --no-compile` trains: its cast kernels, fp32 "
    "softmax/LayerNorm/cross-entropy and fp32 activations (planner/profile/autocast.py)"
)


def save_profile(profile: ModelProfile | ClusterProfile, path: str | Path) -> Path:
    """Write a profile atomically with its content hash."""
    return save_document(profile, path)


ModelProfile.model_rebuild()
