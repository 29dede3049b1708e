"""Context parallelism (long context): each sequence split over ``cp`` ranks.

Layout (Megatron-Core's context parallelism, docs "context_parallel" user guide; Liu et al. 2023 Ring
Attention for the ring): the ``s`` tokens of a sample are cut into ``2 cp`` equal chunks and cp rank ``r``
holds chunks ``r`` and ``2 cp - 1 - r``, so under a causal mask every rank has the same attention work
(one early, one late chunk). Every layer but attention is token-wise and runs on the rank's ``s / cp``
tokens; attention needs every earlier token's keys and values, exchanged in one of two ways (the plan
names which, ``Plan.context_parallel``):

- ``allgather``: all-gather K and V over the cp group before the attention, reduce-scatter their gradients
  after its backward (Llama 3, Grattafiori et al. 2024, arXiv:2407.21783, §3.3.2 "Context parallelism":
  all-gather-based CP with K/V far smaller than Q under GQA; the exchange is not overlapped). The gathered
  K/V stay saved for the backward (what ``runtime/executor/context.py`` and autograd do for this exchange).
- ``ring``: ``cp - 1`` point-to-point steps pass K/V chunks round the cp ring while each rank computes the
  attention block of the chunk it holds (Ring Attention, Liu et al. 2023, arXiv:2310.01889, §3; Megatron-Core
  ``cp_comm_type p2p``); the backward passes K/V and dK/dV (twice the bytes). Each step's transfer hides
  behind that step's block of attention: exposed ``max(t - (1 - k) w, k t)`` per step with ``w`` the
  attention time of one block and ``k`` the node's contention (``kernels.contention``), as every overlapped
  collective of this cost model. Only two K/V blocks are alive at a time: nothing extra is saved.

What the split divides (per rank, per sample; Korthikanti et al. 2022 §4 for the activation terms): every FLOP
(token-wise layers by ``cp``; causal attention by ``cp`` as well, thanks to the balanced layout: chunk ``i`` attends
to ``i + 1/2`` chunk-blocks of the causal triangle, so rank ``r`` does ``(r + 1/2) + (2cp - 1 - r + 1/2) = 2cp`` of
its ``2cp^2`` blocks; non-causal dense attention computes ``s/cp x s`` scores, ``1/cp`` as well), every saved
activation (inputs, Q/K/V, MLP intermediates, and the ``s x s`` scores to ``s/cp x s``), the pipeline send and the
TP/SP collectives' bytes. Not divided: weights, gradients and optimizer states (replicated over cp, sharded by ZeRO
over ``dp x cp``), the gathered K/V in ``allgather`` mode (``(1 - 1/cp)`` of a full sequence's K and V per attention
layer is added back), and the embedding's weight gradient. Gradients are synchronised (and ZeRO-sharded) over the
``dp x cp`` group: each cp rank's weight gradients are partial sums over its tokens (Megatron-Core reduces gradients
over the DP x CP group).

Implementation: a configuration ``(tp, pp, dp, cp)`` on model ``M`` with global batch ``B`` is costed as
``(tp, pp, dp * cp)`` on :func:`context_view` of ``M`` — whose "sample" is one rank's ``s/cp`` tokens of a
sequence, with every per-sample figure divided by ``cp`` — with global batch ``B cp`` and the K/V exchange
(:class:`KVExchange`) added to each attention layer. The rank layout ``pp, dp, cp, tp`` makes the ``dp x cp``
group exactly the folded ``dp * cp`` group (``tp`` apart), so the data-parallel machinery applies unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from planner.core import ATTENTION_DTYPE, CONTEXT_MODES, DTYPE_BYTES, ContextMode, StratagemError
from planner.cost.collectives import collective_time
from planner.cost.config import ParallelConfig
from planner.cost.placement import dp_group
from planner.profile import ClusterProfile, LayerProfile, LayerTiming, ModelProfile, NodeType, OpProfile, ShardProfile

if TYPE_CHECKING:
    from planner.model import ModelSpec

# Model families whose attention the runtime can split (runtime/executor/context.py): the zoo's gpt and llama.
CONTEXT_FAMILIES = ("gpt", "llama")


class ContextParallelError(StratagemError):
    """A context-parallel degree the model or sequence cannot take."""


@dataclass(frozen=True, kw_only=True, slots=True)
class KVExchange:
    """How one attention layer exchanges K/V over its cp group (one rank's view, per sample of the view).

    ``kv_bytes_per_sample``: K and V of a whole sequence at tp=1 (``2 s h_kv e`` bytes); a rank of a
    tensor-split layer holds ``1/tp`` of the heads.
    """

    cp: int
    mode: ContextMode
    kv_bytes_per_sample: float


def check_context_family(spec: ModelSpec, cp: int) -> None:
    """Reject ``cp > 1`` for a ``planner.model.spec.ModelSpec`` whose attention cannot be split (before any
    profile of it is built)."""
    if cp > 1 and spec.family not in CONTEXT_FAMILIES:
        what = "no attention to split" if spec.family in ("resnet", "mlp") else "attention the runtime cannot split"
        raise ContextParallelError(
            f"context parallelism splits the sequence over attention, and {spec.name} ({spec.family}) has {what} "
            f"(the zoo's gpt:* and llama:* models only); use --cp 1"
        )


def check_context(model: ModelProfile, cp: int, mode: str | None) -> None:
    """Reject a cp degree the model cannot take, with the fix (one line)."""
    if cp < 1:
        raise ContextParallelError(f"--cp {cp} must be >= 1")
    if cp == 1:
        return
    if mode not in CONTEXT_MODES:
        raise ContextParallelError(f"context-parallel mode {mode!r} is unknown; use one of {', '.join(CONTEXT_MODES)}")
    check_context_family(model.model, cp)
    if model.seq_len <= 1:
        raise ContextParallelError(f"{model.model.name} trains 1-token samples: nothing to split; use --cp 1")
    if model.seq_len % (2 * cp):
        raise ContextParallelError(
            f"--seq {model.seq_len} does not split into 2 x cp = {2 * cp} equal chunks (causal load balancing "
            f"gives each cp rank two chunks); choose --seq a multiple of {2 * cp} or a cp dividing {model.seq_len // 2}"
        )


def kv_bytes_per_sample(model: ModelProfile) -> float:
    """K and V of one full sequence at tp=1, in attention's dtype (``constants.ATTENTION_DTYPE``: BF16 under an
    FP8 recipe): ``2 s h_kv e`` (GQA: ``h_kv = h kv/a``)."""
    dims = model.model.dims
    h, a = int(dims.get("hidden", 0) or 0), int(dims.get("heads", 0) or 0)
    kv = int(dims.get("kv_heads", 0) or 0) if model.model.family == "llama" else 0
    h_kv = h * (kv or a) // a if a else h
    return 2.0 * model.seq_len * h_kv * DTYPE_BYTES[ATTENTION_DTYPE.get(model.dtype, model.dtype)]


def is_attention(layer: LayerProfile) -> bool:
    """A layer whose work includes the ``s x s`` attention (the only one that exchanges K/V)."""
    return layer.shards[0].attention_scores_flops_per_sample > 0


def _view_op(op: OpProfile, cp: int) -> OpProfile:
    """One kernel on ``s / cp`` tokens: a GEMM's rows (tokens; attention's query rows: its ``n``/``k`` over
    all keys stay), a memory kernel's bytes (the score-sized ones too: ``s/cp x s``)."""
    return op.model_copy(
        update={
            "rows_per_sample": op.rows_per_sample // cp if op.kind == "gemm" else op.rows_per_sample,
            "bytes_per_sample": op.bytes_per_sample / cp,
            "backward_bytes_per_sample": op.backward_bytes_per_sample / cp,
        }
    )


def _view_timing(t: LayerTiming, cp: int) -> LayerTiming:
    scale = {"median_s", "min_s", "max_s"}
    fwd = t.forward.model_copy(update={k: getattr(t.forward, k) / cp for k in scale})
    bwd = t.backward.model_copy(update={k: getattr(t.backward, k) / cp for k in scale})
    return t.model_copy(update={"forward": fwd, "backward": bwd})


def _view_shard(shard: ShardProfile, cp: int) -> ShardProfile:
    per_sample = (
        "fwd_flops_per_sample",
        "bwd_flops_per_sample",
        "saved_bytes_per_sample",
        "saved_replicated_bytes_per_sample",
        "saved_attention_scores_bytes_per_sample",
        "attention_scores_flops_per_sample",
        "backward_ws_bytes_per_sample",
        "logits_bytes_per_sample",
    )
    update: dict = {k: getattr(shard, k) / cp for k in per_sample}
    update["ops"] = [_view_op(op, cp) for op in shard.ops]
    update["timings"] = [_view_timing(t, cp) for t in shard.timings]
    return shard.model_copy(update=update)


def _view_layer(layer: LayerProfile, cp: int, same: LayerProfile | None = None) -> LayerProfile:
    """``layer``'s view; ``same``: the view of an earlier layer with the same signature (identical by the
    profile's contract), whose shards and collectives are shared."""
    return layer.model_copy(
        update={
            "signature": f"{layer.signature}|cp{cp}",
            "input_bytes_per_sample": layer.input_bytes_per_sample / cp,
            "output_bytes_per_sample": layer.output_bytes_per_sample / cp,
            "shards": same.shards if same else [_view_shard(s, cp) for s in layer.shards],
            "collectives": same.collectives
            if same
            else [c.model_copy(update={"bytes_per_sample": c.bytes_per_sample / cp}) for c in layer.collectives],
        }
    )


def context_view(model: ModelProfile, cp: int) -> ModelProfile:
    """``model`` as one cp rank sees it: a sample is ``s / cp`` tokens of a sequence (two chunks), every
    per-sample figure divided by ``cp`` (see the module docstring for why attention divides too)."""
    if cp == 1:
        return model
    seen: dict[str, LayerProfile] = {}
    layers = []
    for layer in model.layers:
        view = _view_layer(layer, cp, seen.get(layer.signature))
        seen.setdefault(layer.signature, view)
        layers.append(view)
    return model.model_copy(update={"seq_len": model.seq_len // cp, "layers": layers, "content_hash": None})


def kv_exchange(model: ModelProfile, cp: int, mode: ContextMode) -> KVExchange:
    """The K/V exchange of ``model``'s attention layers at ``cp`` (``model``: the full-sequence profile)."""
    return KVExchange(cp=cp, mode=mode, kv_bytes_per_sample=kv_bytes_per_sample(model))


@dataclass(frozen=True, kw_only=True, slots=True)
class ExchangeCost:
    """Per micro-batch on one rank: exposed exchange seconds forward and backward, and extra saved bytes."""

    forward_s: float
    backward_s: float
    saved_bytes: float


def exchange_cost(
    ex: KVExchange,
    *,
    cluster: ClusterProfile,
    node: NodeType,
    tp: int,
    samples: int,
    attention_forward_s: float,
    attention_backward_s: float,
    contention: float,
) -> ExchangeCost:
    """The K/V exchange of one attention layer for ``samples`` samples on a rank of a ``tp``-way shard.

    ``allgather``: forward all-gather of the full K/V, backward reduce-scatter of dK/dV (exposed);
    ``(1 - 1/cp)`` of the full K/V saved on top of the rank's own. ``ring``: ``cp - 1`` steps of one
    chunk-pair's K/V (``1/cp`` of the full bytes) forward, K/V + dK/dV backward, each behind ``1/cp`` of the
    rank's attention time. The cp group is ``cp`` ranks ``tp`` apart (mesh ``pp, dp, cp, tp``).
    """
    full = ex.kv_bytes_per_sample * samples / tp
    group = dp_group(ex.cp, tp, node.devices_per_node)
    coll: dict[str, Any] = dict(node_type=node, spans_nodes=group.spans_nodes, ranks_per_node=group.ranks_per_node)
    if ex.mode == "allgather":
        return ExchangeCost(
            forward_s=collective_time(cluster, "all_gather", full, ex.cp, **coll),
            backward_s=collective_time(cluster, "reduce_scatter", full, ex.cp, **coll),
            saved_bytes=full * (1 - 1 / ex.cp),
        )
    p2p: dict[str, Any] = dict(node_type=node, spans_nodes=group.spans_nodes, ranks_per_node=1)
    steps = ex.cp - 1

    def exposed(nbytes: float, window_s: float) -> float:
        t = collective_time(cluster, "send_recv", nbytes, 2, **p2p)
        return steps * max(t - (1 - contention) * window_s, contention * t)

    return ExchangeCost(
        forward_s=exposed(full / ex.cp, attention_forward_s / ex.cp),
        backward_s=exposed(2 * full / ex.cp, attention_backward_s / ex.cp),
        saved_bytes=0.0,
    )


def fold(config: ParallelConfig, model: ModelProfile, global_batch: int) -> tuple[ModelProfile, ParallelConfig, int]:
    """(view, folded config, folded global batch): ``config`` with ``cp > 1`` as a ``dp * cp`` configuration
    on :func:`context_view` (module docstring). ``config`` is a ``planner.cost.ParallelConfig``."""
    check_context(model, config.cp, config.context_parallel or "allgather")
    if config.batch_shares is not None or config.replica_node_types is not None:
        raise ContextParallelError(
            "context parallelism with uneven batch shares or per-replica node types is not modelled; use --cp 1 "
            "on mixed clusters"
        )
    view, exchange, batch = fold_parts(model, config.cp, config.context_parallel, global_batch)
    folded = replace(config, dp=config.dp * config.cp, cp=1, context_parallel=None, kv_exchange=exchange)
    return view, folded, batch


def fold_parts(
    model: ModelProfile, cp: int, mode: str | None, global_batch: int, *, view: ModelProfile | None = None
) -> tuple[ModelProfile, KVExchange, int]:
    """The model side of the fold, shared by :func:`fold` and the search (``planner.search.costs``): the per-rank
    view of ``model`` (``view`` when the caller has it already), the K/V exchange of ``mode`` (None: all-gather)
    and the folded global batch ``B cp``. The degrees fold as ``dp -> dp cp, cp -> 1`` on the caller's record."""
    mode = mode or "allgather"
    check_context(model, cp, mode)
    exchange = kv_exchange(model, cp, mode)  # type: ignore[arg-type]
    return view if view is not None else context_view(model, cp), exchange, global_batch * cp


def cp_degrees(model: ModelProfile, gpus: int) -> tuple[int, ...]:
    """Context-parallel degrees the search may try: 1, and every divisor of ``gpus`` whose ``2 cp``
    chunks split the sequence evenly, for models whose attention the runtime can split."""
    if model.model.family not in CONTEXT_FAMILIES or model.seq_len <= 1:
        return (1,)
    return tuple(cp for cp in range(1, gpus + 1) if gpus % cp == 0 and model.seq_len % (2 * cp) == 0) or (1,)


def unfold(folded: ParallelConfig, cp: int, mode: str | None) -> ParallelConfig:
    """The user's configuration of a folded one (inverse of :func:`fold`)."""
    if cp == 1:
        return folded
    return replace(folded, dp=folded.dp // cp, cp=cp, context_parallel=mode, kv_exchange=None)  # type: ignore[arg-type]


def plan_context_fields(plan) -> dict:
    """The :class:`ParallelConfig` fields of a ``planner.plan.schema.Plan`` that context parallelism and the attention
    kernel set (its K/V exchange, flash attention with causal skipping; the degree is in ``plan.parallel_dims``):
    what its predictions assumed."""
    cp = plan.mesh.size("cp")
    return dict(
        context_parallel=plan.context_parallel if cp > 1 else None,
        flash_attention=plan.flash_attention,
        causal_skip=plan.flash_attention,
    )
