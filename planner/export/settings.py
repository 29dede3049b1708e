"""What a training framework's config can say about a run: :class:`FrameworkSettings`.

Megatron-LM, torchtitan, DeepSpeed and Accelerate configure parallelism with a handful of global knobs
(degrees, micro-batch, schedule, one recompute mode, ZeRO stage); a Stratagem plan can say more (per-layer
recompute, replicate-or-split per layer, any stage boundaries, per-replica batch shares). This record is
the common part: every exporter writes one, every importer reads one, and :func:`to_parallel_config` turns
it into the cost model's :class:`ParallelConfig` so the exported (or imported) configuration can be
estimated exactly as the planner estimates its own plans.

Vocabulary as in ``planner/plan/schema.py``: degrees ``tp``, ``pp``, ``dp``, ``cp`` (context), ``ep`` (expert);
a *chunk* is one pipeline model chunk (``pp * virtual_stages`` of them, chunk ``i`` on pp rank ``i % pp``).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.core import ParallelDims, Recompute, ScheduleKind, StratagemError
from planner.cost import MemorySemantics, ParallelConfig
from planner.model import ModelSpec
from planner.plan import LRSchedule

FRAMEWORKS = ("megatron", "torchtitan", "deepspeed", "accelerate")


@dataclass(frozen=True, kw_only=True, slots=True)
class FrameworkSettings:
    """One run as a framework config states it.

    ``first_chunk_blocks`` / ``last_chunk_blocks``: blocks on the first / last pipeline chunk when they differ
    from the even split (Megatron's ``--decoder-first/last-pipeline-num-layers``); ``None`` = even.
    ``recompute_blocks_per_chunk``: with ``recompute="full"``, only the first N blocks of every chunk are
    recomputed (Megatron's ``--recompute-method block --recompute-num-layers N``); ``None`` = every block.
    ``model`` and ``lr_schedule`` are ``None`` where the source config does not carry them.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1  # tensor parallel inside the experts (Megatron --expert-tensor-parallel-size)
    micro_batch: int = 1
    global_batch: int = 1
    schedule: ScheduleKind = "1f1b"
    virtual_stages: int = 1
    first_chunk_blocks: int | None = None
    last_chunk_blocks: int | None = None
    zero_stage: int = 0
    sequence_parallel: bool = False
    recompute: Recompute = "none"
    recompute_blocks_per_chunk: int | None = None
    overlap_grad_reduce: bool = True
    seq_len: int | None = None
    dtype: str | None = None
    model: ModelSpec | None = None
    lr_schedule: LRSchedule | None = None
    weight_decay: float | None = None
    # context parallelism's K/V exchange (planner/cost/context.py): "allgather" or "ring"; None with cp 1
    context_parallel: str | None = None
    flash_attention: bool = False  # fused causal flash attention (Megatron --use-flash-attn)

    @property
    def world_size(self) -> int:
        """``tp x pp x dp x cp`` ranks (read before the layout is validated, so no :attr:`parallel_dims`)."""
        return self.tp * self.pp * self.dp * self.cp

    @property
    def parallel_dims(self) -> ParallelDims:
        """The framework config's degrees as the one layout record (:class:`planner.core.ParallelDims`)."""
        return ParallelDims.with_axes(pp=self.pp, dp=self.dp, cp=self.cp, tp=self.tp, ep=self.ep, etp=self.etp)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per replica per step (gradient accumulation x pipeline micro-batches)."""
        return self.global_batch // (self.dp * self.micro_batch)


def check_settings(s: FrameworkSettings, *, source: str, names: dict[str, str] | None = None) -> None:
    """Reject contradictory degrees and batches with one line naming the framework's flag or key
    (``names``: field -> flag, e.g. ``{"tp": "--tensor-model-parallel-size"}``)."""

    def n(field_name: str) -> str:
        return (names or {}).get(field_name, field_name)

    for name in ("tp", "pp", "dp", "cp", "ep", "etp", "micro_batch", "global_batch", "virtual_stages"):
        if getattr(s, name) < 1:
            raise StratagemError(f"{source}: {n(name)} is {getattr(s, name)}; it must be a positive integer")
    if s.global_batch % (s.dp * s.micro_batch):
        raise StratagemError(
            f"{source}: {n('global_batch')} {s.global_batch} is not a multiple of data-parallel "
            f"size {s.dp} x {n('micro_batch')} {s.micro_batch}; change one of them"
        )
    if s.virtual_stages > 1 and s.pp == 1:
        raise StratagemError(
            f"{source}: {n('virtual_stages')} needs {n('pp')} > 1; raise it or drop the virtual stages"
        )
    if s.schedule != "gpipe" and s.pp > 1 and s.num_micro_batches < s.pp:
        raise StratagemError(
            f"{source}: 1F1B with {n('pp')} {s.pp} needs >= {s.pp} micro-batches per step but "
            f"{n('global_batch')} {s.global_batch} / (dp {s.dp} x {n('micro_batch')} "
            f"{s.micro_batch}) = {s.num_micro_batches}; raise the global batch or lower the "
            f"micro-batch"
        )
    if s.virtual_stages > 1 and s.num_micro_batches % s.pp:
        raise StratagemError(
            f"{source}: interleaved 1F1B needs the micro-batches per step ({s.num_micro_batches}) "
            f"to be a multiple of {n('pp')} {s.pp} (Megatron-LM); change {n('global_batch')} or "
            f"{n('micro_batch')}"
        )
    if s.sequence_parallel and s.tp == 1:
        raise StratagemError(f"{source}: {n('sequence_parallel')} needs {n('tp')} > 1; drop it or raise {n('tp')}")
    if s.recompute_blocks_per_chunk is not None and s.recompute != "full":
        raise StratagemError(f"{source}: a recompute layer count needs full recompute granularity")
    if s.model is not None:
        heads = int(s.model.dim("heads"))
        if heads % s.tp:
            raise StratagemError(
                f"{source}: {heads} attention heads do not split over {n('tp')} {s.tp}; choose a divisor of {heads}"
            )
        layers = int(s.model.dim("layers"))
        if layers < s.pp * s.virtual_stages:
            raise StratagemError(
                f"{source}: {layers} layers cannot fill {n('pp')} {s.pp} x {s.virtual_stages} "
                f"virtual stages; lower {n('pp')}"
            )


def chunk_paths(layers: list[tuple[str, str]], s: FrameworkSettings) -> list[list[str]]:
    """Module paths of each chunk: blocks split evenly (earlier chunks take the remainder, as the cost model
    does), or with ``first/last_chunk_blocks`` and the rest even; non-blocks join the first / last chunk.
    ``layers`` is ``[(path, kind), ...]`` in model order."""
    n = s.pp * s.virtual_stages
    blocks = [p for p, kind in layers if kind == "block"] or [p for p, _ in layers]
    first = s.first_chunk_blocks
    last = s.last_chunk_blocks
    counts: list[int]
    if first is None and last is None:
        base, extra = divmod(len(blocks), n)
        counts = [base + (1 if c < extra else 0) for c in range(n)]
    else:
        middle_chunks = n - (first is not None) - (last is not None)
        rest = len(blocks) - (first or 0) - (last or 0)
        if middle_chunks <= 0 or rest < middle_chunks or rest % middle_chunks:
            raise StratagemError(
                f"{len(blocks)} layers with {first} on the first and {last} on the last chunk "
                f"leave {rest} for {middle_chunks} chunks; make the rest divide evenly"
            )
        each = rest // middle_chunks
        counts = ([first] if first is not None else []) + [each] * middle_chunks + ([last] if last is not None else [])
    out, start = [], 0
    for count in counts:
        out.append(blocks[start : start + count])
        start += count
    head = [p for p, _ in layers[: [p for p, _ in layers].index(blocks[0])]]
    tail_start = [p for p, _ in layers].index(blocks[-1]) + 1
    out[0] = head + out[0]
    out[-1] = out[-1] + [p for p, _ in layers[tail_start:]]
    return out


# whose memory the cost model prices for each framework's config (ParallelConfig.memory_semantics): Megatron-LM
# and DeepSpeed keep gradients through the step in buckets (textbook ZeRO); torchtitan and Accelerate's FSDP2 are
# FSDP2, as `stratagem launch` is
FRAMEWORK_MEMORY: dict[str, MemorySemantics] = {
    "megatron": "textbook",
    "deepspeed": "textbook",
    "torchtitan": "fsdp2",
    "accelerate": "fsdp2",
}


def to_parallel_config(
    s: FrameworkSettings, layers: list[tuple[str, str]], framework: str | None = None
) -> ParallelConfig:
    """The cost model's configuration for ``s`` (``layers``: ``[(path, kind), ...]`` in model order), priced as
    ``framework`` holds memory (:data:`FRAMEWORK_MEMORY`; None: as `stratagem launch` does).

    Every TP-capable layer is split (Megatron's vocab-parallel embedding and head; the cost model's default
    layout); explicit chunk boundaries only where the split is uneven or the recompute is per-layer.
    """
    if s.ep > 1 and s.cp > 1:
        raise StratagemError(
            f"context parallel {s.cp} with expert parallel {s.ep}: the cost model does not estimate both at once "
            f"yet; set one of them to 1 to estimate the rest"
        )
    explicit = s.first_chunk_blocks is not None or s.last_chunk_blocks is not None
    chunks = chunk_paths(layers, s) if explicit or s.recompute_blocks_per_chunk is not None else None
    recompute: Recompute | dict[str, Recompute] = s.recompute
    if s.recompute_blocks_per_chunk is not None and chunks is not None:
        kinds = dict(layers)
        recompute = {
            p: "full"
            for chunk in chunks
            for p in [q for q in chunk if kinds[q] == "block"][: s.recompute_blocks_per_chunk]
        }
    return ParallelConfig(
        memory_semantics=FRAMEWORK_MEMORY.get(framework or "", "fsdp2"),
        tp=s.tp,  # the degrees as stated (parallel_dims would refuse an ep the experts' check names better)
        pp=s.pp,
        dp=s.dp,
        cp=s.cp,
        ep=s.ep,
        etp=s.etp,
        micro_batch=s.micro_batch,
        num_micro_batches=s.num_micro_batches,
        schedule=s.schedule,
        virtual_stages=s.virtual_stages,
        zero_stage=s.zero_stage,
        sequence_parallel=s.sequence_parallel,
        recompute=recompute,
        stage_layers=tuple(tuple(c) for c in chunks) if chunks is not None and explicit else None,
        overlap_grad_reduce=s.overlap_grad_reduce,
        context_parallel=(s.context_parallel or "ring") if s.cp > 1 else None,  # type: ignore[arg-type]
        flash_attention=s.flash_attention,
        causal_skip=s.flash_attention,
    )
