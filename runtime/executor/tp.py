"""Tensor (and sequence) parallelism from the plan's per-layer layout: ``tp_styles`` + ``apply_tp``.

The plan says, per top-level module path, ``split`` (tensor-parallel on the ``tp`` axis) or
``replicate`` (Whale's two choices, Jia et al. ATC'22), and for split layers whether sequence
parallelism is on. For a split layer the zoo's ``tp_layout(spec, path)`` names the style of each
submodule (plain data); this file turns the whole model's layout into one plain dict, submodule path ->
style name, and maps the names to torch.distributed.tensor.parallel styles:

| style name | torch style | source |
|---|---|---|
| colwise | ``ColwiseParallel()`` | Megatron-LM (Shoeybi et al. 2019 §3): column-split first GEMM |
| rowwise | ``RowwiseParallel()``: output all-reduced | row-split second GEMM |
| rowwise_to_sequence | ``RowwiseParallel(output_layouts=Shard(1))``: reduce-scatter over the sequence | Korthikanti et al. 2022 §4.2.2 |
| gather_sequence | ``PrepareModuleInput(Shard(1) -> Replicate)``: all-gather the sequence | same |
| sequence_parallel | ``SequenceParallel()`` on a norm inside a block | same |
| sequence_parallel_local | ``SequenceParallel(use_local_output=True)`` on a top-level norm | same |
| scatter_sequence | ``PrepareModuleOutput(Replicate -> Shard(1))`` (a local slice, no communication) | — |
| vocab_embedding | ``RowwiseParallel(input_layouts=Replicate())`` on an embedding | Megatron VocabParallelEmbedding |
| colwise_sharded_output(_from_sequence) | ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)`` (input Shard(1) when fed by a sequence shard): class-sharded logits for ``loss_parallel`` | Whale's split classifier |

| replica | nothing: a replica between replicas (its input is already a batch slice) | Whale's replica |
| batch_slice(_from_sequence) | ``PrepareModuleInput(R (or S) -> Shard(0))``: a replica's batch slice (local) | Whale's replica |
| gather_batch | ``PrepareModuleInput(Shard(0) -> R)``: all-gather along the batch (backward: reduce-scatter) | same |
| batch_to_sequence | ``PrepareModuleInput(Shard(0) -> S)`` | same |
| gather_batch_output / batch_slice_gather_output | ``PrepareModule(Input)Output``: a replica's output made whole again | same |
| gather_scatter_sequence | ``PrepareModuleInputOutput(S -> R, R -> S)``: a whole-batch replica between sequence shards | — |
| batch(_slice)_to_sequence_output | as gather_batch_output / batch_slice_gather_output, output a sequence shard: a replica ending its stage before a sequence-parallel one | — |
| colwise_sharded_output_from_batch | as colwise_sharded_output, input Shard(0) (all-gathered) | same |

Replicated layers under ``tp > 1`` are Whale's replicas: data-parallel INSIDE the TP group, each rank
computing a batch slice (B, a local ``(batch/tp, ...)`` tensor: ``Shard(0)`` of the micro-batch); their
gradients are summed over the TP group by :class:`ReplicaGradSync` (and averaged over DP by the DP wrapper).
Where the micro-batch does not split evenly over tp (one sample over two ranks), every TP rank runs them on the
whole micro-batch instead (R in and out; ``tp_styles(whole_batch_replicas=True)``), with nothing to sum.
A replica's output is made whole (``gather_batch_output``) where it leaves the stage or the model, so
pipeline sends and the loss see the whole micro-batch.

Between top-level layers the activation is either replicated (R), a sequence shard (S, a local
``(batch, seq/tp, hidden)`` tensor) or a batch slice (B). A sequence-parallel block takes and returns S; everything else
takes and returns R (a split head takes either). Where neighbours disagree, R -> S is a
``scatter_sequence`` on the producer and S -> R a ``gather_sequence`` on the consumer, so each pipeline
stage applies exactly the conversions of the layers it holds. The GPT embedding adds position
embeddings after the token lookup, so its output is R (an all-reduce, not Megatron-SP's reduce-scatter).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from planner.core import StratagemError
from planner.model import ModelSpec
from planner.plan import LayerLayout, Plan

SEQ = Shard(1)  # (batch, seq, hidden): dim 1 is the sequence
BATCH = Shard(0)


def _prep_in(src, dst):
    return lambda: PrepareModuleInput(input_layouts=(src,), desired_input_layouts=(dst,), use_local_output=True)


TP_STYLES = {  # style name -> factory of the torch ParallelStyle (public: the overhead profiler uses it too)
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "rowwise_to_sequence": lambda: RowwiseParallel(output_layouts=SEQ),
    "gather_sequence": lambda: PrepareModuleInput(
        input_layouts=(SEQ,), desired_input_layouts=(Replicate(),), use_local_output=True
    ),
    "sequence_parallel": lambda: SequenceParallel(),
    "sequence_parallel_local": lambda: SequenceParallel(use_local_output=True),
    "scatter_sequence": lambda: PrepareModuleOutput(
        output_layouts=(Replicate(),), desired_output_layouts=(SEQ,), use_local_output=True
    ),
    "vocab_embedding": lambda: RowwiseParallel(input_layouts=Replicate()),
    "colwise_sharded_output": lambda: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    "colwise_sharded_output_from_sequence": lambda: ColwiseParallel(
        input_layouts=SEQ, output_layouts=Shard(-1), use_local_output=False
    ),
    "colwise_sharded_output_from_batch": lambda: ColwiseParallel(
        input_layouts=BATCH, output_layouts=Shard(-1), use_local_output=False
    ),
    "replica": None,  # a replica fed a batch slice and feeding one: nothing to apply (ReplicaGradSync)
    "batch_slice": _prep_in(Replicate(), BATCH),
    "batch_slice_from_sequence": _prep_in(SEQ, BATCH),
    "gather_batch": _prep_in(BATCH, Replicate()),
    "batch_to_sequence": _prep_in(BATCH, SEQ),
    "gather_batch_output": lambda: PrepareModuleOutput(
        output_layouts=(BATCH,), desired_output_layouts=(Replicate(),), use_local_output=True
    ),
    "gather_scatter_sequence": lambda: PrepareModuleInputOutput(
        input_layouts=(SEQ,),
        desired_input_layouts=(Replicate(),),
        use_local_input=True,
        output_layouts=(Replicate(),),
        desired_output_layouts=(SEQ,),
        use_local_output=True,
    ),
    "batch_to_sequence_output": lambda: PrepareModuleOutput(
        output_layouts=(BATCH,), desired_output_layouts=(SEQ,), use_local_output=True
    ),
    "batch_slice_to_sequence_output": lambda: PrepareModuleInputOutput(
        input_layouts=(Replicate(),),
        desired_input_layouts=(BATCH,),
        use_local_input=True,
        output_layouts=(BATCH,),
        desired_output_layouts=(SEQ,),
        use_local_output=True,
    ),
    "batch_slice_gather_output": lambda: PrepareModuleInputOutput(
        input_layouts=(Replicate(),),
        desired_input_layouts=(BATCH,),
        use_local_input=True,
        output_layouts=(BATCH,),
        desired_output_layouts=(Replicate(),),
        use_local_output=True,
    ),
}
_INTO_BATCH = {"R": "batch_slice", "S": "batch_slice_from_sequence"}
_FROM_BATCH = {"R": "gather_batch", "S": "batch_to_sequence"}
_REPLICA_STYLES = (
    "replica",
    "batch_slice",
    "batch_slice_from_sequence",
    "gather_batch_output",
    "batch_slice_gather_output",
    "batch_to_sequence_output",
    "batch_slice_to_sequence_output",
)


def _join(path: str, rel: str) -> str:
    return f"{path}.{rel}" if rel else path


def _layer_styles(spec: ModelSpec, path: str, sp: bool, incoming: str) -> tuple[dict[str, str], str, str]:
    """(styles of one split layer, the activation layout it takes, the one it returns)."""
    from runtime.models import tp_layout

    zoo = tp_layout(spec, path)
    styles: dict[str, str] = {}
    if not sp:
        for rel, style in zoo.items():
            if style == "sequence_parallel":
                continue
            styles[_join(path, rel)] = style
        if "colwise_sharded_output" in zoo.values() and incoming == "S":
            styles = {k: v + "_from_sequence" if v == "colwise_sharded_output" else v for k, v in styles.items()}
            return styles, "S", "C"
        return styles, "R", ("C" if "colwise_sharded_output" in zoo.values() else "R")
    if spec.is_external:
        raise StratagemError(
            f"layer {path} of {spec.name}: sequence parallelism is implemented for the zoo's gpt and "
            f"llama only; re-plan (stratagem plan does not search it for this model)"
        )
    if spec.family not in ("gpt", "llama", "moe"):
        raise StratagemError(
            f"layer {path} of {spec.name} has no sequence dimension for sequence parallelism; re-plan without it"
        )
    if zoo == {"": "sequence_parallel"}:  # a top-level norm
        return {path: "sequence_parallel_local"}, "S", "S"
    if "colwise_sharded_output" in zoo.values() or "vocab_embedding" in zoo.values():
        return _layer_styles(spec, path, False, incoming)  # head / embedding: SP changes only their neighbours
    for rel, style in zoo.items():
        if style == "rowwise":
            style = "rowwise_to_sequence"
        elif style == "colwise":
            styles[_join(path, rel.rpartition(".")[0])] = "gather_sequence"  # the colwise Linear's parent
        styles[_join(path, rel)] = style
    return styles, "S", "S"


def plan_tp_styles(plan: Plan, paths: Sequence[str]) -> dict[str, str]:
    """:func:`tp_styles` of ``plan`` for the modules in ``paths``: replicated layers run on batch slices when the
    micro-batch splits evenly over tp, else on the whole micro-batch (``whole_batch_replicas``)."""
    tp = plan.mesh.size("tp")
    whole = tp > 1 and plan.schedule.micro_batch_size % tp != 0
    return tp_styles(plan.model, plan.layout, paths, whole_batch_replicas=whole)


def tp_styles(
    spec: ModelSpec,
    layout: Mapping[str, LayerLayout],
    paths: Sequence[str],
    *,
    whole_batch_replicas: bool = False,
) -> dict[str, str]:
    """Plain-data TP plan for the modules in ``paths`` (one pipeline stage, or the whole model):
    full submodule path -> style name (see the table above).

    ``whole_batch_replicas`` (a micro-batch that does not split evenly over tp, e.g. one sample over two ranks):
    a replicated layer runs on the whole micro-batch on every TP rank (R in and out, gathered from a sequence
    shard first), as Megatron-LM runs the layers it does not split; its gradients are then equal on the TP ranks
    (the split neighbours' backward all-reduces the activation gradient), so nothing sums them."""
    from runtime.models import layer_paths

    plan: dict[str, str] = {}
    keep = tuple(paths)
    order = list(layer_paths(spec))
    prev_out, prev_path = "R", None
    for n, path in enumerate(order):
        lay = layout.get(path)
        split = lay is not None and lay.style == "split"
        if prev_out == "B" and prev_path not in keep:
            prev_out = "R"  # the other stage made its replica's output whole before sending it
        if not split and whole_batch_replicas:
            _whole_replica(plan, path, prev_out)
            prev_out, prev_path = "R", path
            continue
        if not split:
            _replica(plan, path, prev_out, last=n + 1 == len(order) or path in keep and order[n + 1] not in keep)
            prev_out, prev_path = ("R" if plan[path].endswith("output") else "B"), path
            continue
        assert lay is not None  # split
        styles, want, out = _layer_styles(spec, path, bool(lay.sequence_parallel), prev_out)
        if prev_out == "R" and want == "S" and prev_path in keep:  # (another stage's layer: that stage scatters)
            plan[prev_path] = _then_scatter(prev_path, plan.get(prev_path))
        elif prev_out == "S" and want == "R":
            styles[path] = "gather_sequence"
        elif prev_out == "B":
            _from_batch(styles, path, want)
        plan.update(styles)
        prev_out, prev_path = out, path
    return {k: v for k, v in plan.items() if any(k == p or k.startswith(p + ".") for p in keep)}


_SCATTERED = {  # a layer's own style -> the style that also leaves its output a sequence shard
    None: "scatter_sequence",
    "gather_sequence": "gather_scatter_sequence",  # a whole replica fed by a sequence shard
    "gather_batch_output": "batch_to_sequence_output",  # a batch-sliced replica ending its stage
    "batch_slice_gather_output": "batch_slice_to_sequence_output",
}


def _then_scatter(path: str, own: str | None) -> str:
    """The style of ``path`` whose output must become a sequence shard for the next (sequence-parallel) layer."""
    if own not in _SCATTERED:
        raise StratagemError(
            f"layer {path} ({own}) cannot hand a sequence shard to the sequence-parallel layer after it; "
            f"split both or neither with sequence parallelism"
        )
    return _SCATTERED[own]


def _whole_replica(plan: dict[str, str], path: str, incoming: str) -> None:
    """Styles of a replicated layer on the whole micro-batch (``whole_batch_replicas``): a sequence shard is
    gathered into it; nothing else is applied."""
    _after_classifier(path, incoming)
    if incoming == "S":
        plan[path] = "gather_sequence"


def _after_classifier(path: str, incoming: str) -> None:
    """A replicated layer cannot follow a split classifier's class-sharded output (``C``)."""
    if incoming == "C":
        raise StratagemError(
            f"layer {path} is replicated after a split classifier's class-sharded output; split {path} too or re-plan"
        )


def _replica(plan: dict[str, str], path: str, incoming: str, *, last: bool) -> None:
    """Styles of a replicated layer (Whale's replica): slice its input along the batch unless it already is
    a batch slice; make its output whole when it is the last layer of its stage or of the model."""
    _after_classifier(path, incoming)
    if incoming == "B":
        plan[path] = "gather_batch_output" if last else "replica"
        return
    if last:
        if incoming != "R":
            raise StratagemError(
                f"layer {path}: a sequence-sharded input into a stage's last replicated layer is "
                f"not supported; split {path} or re-plan"
            )
        plan[path] = "batch_slice_gather_output"
        return
    plan[path] = _INTO_BATCH[incoming]


def _from_batch(styles: dict[str, str], path: str, want: str) -> None:
    """Feed a split layer from a batch slice: all-gather along the batch (or into a sequence shard)."""
    own = styles.get(path)
    if own == "colwise_sharded_output":
        styles[path] = "colwise_sharded_output_from_batch"
    elif own is None:
        styles[path] = _FROM_BATCH[want]
    else:
        raise StratagemError(
            f"layer {path} ({own}) cannot take a replicated neighbour's batch slice; replicate or split both"
        )


def replica_paths(styles: Mapping[str, str]) -> list[str]:
    """Top-level layers run as batch-sliced replicas (their gradients sync over the TP group)."""
    return [p for p, v in styles.items() if v in _REPLICA_STYLES]


class ReplicaGradSync:
    """Sum the gradients of replica parameters over the TP group (Whale: data parallel inside it).

    Each TP rank's gradient covers its batch slice of the micro-batch's mean loss (the loss itself is the
    whole micro-batch's on every TP rank), so the full gradient is their sum, not their mean. Call after the backward (and the DP wrapper's own reduction), before the optimizer step. Collectives
    run on the TP process group, bounded by the process group's timeout (``init_distributed``).
    """

    def __init__(self, module: nn.Module, tp_mesh, paths: Sequence[str], exclude: set | None = None):
        self.group, self.size = tp_mesh.get_group(), tp_mesh.size()
        self.params = [
            p
            for name, p in module.named_parameters()
            if any(_clean(name) == q or _clean(name).startswith(q + ".") for q in paths) and p not in (exclude or ())
        ]

    def sync(self) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(local, op=dist.ReduceOp.SUM, group=self.group)


def _clean(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def record_replica_rows(module: nn.Module, paths: Sequence[str], seen: dict[str, int]) -> None:
    """Forward pre-hooks (after the slicing hook) recording the batch rows each replica computes."""
    for path in paths:
        sub = module.get_submodule(path)

        def hook(_mod, args, path=path):
            if args and isinstance(args[0], torch.Tensor):
                seen[path] = int(args[0].shape[0])

        sub.register_forward_pre_hook(hook)


def uses_loss_parallel(styles: Mapping[str, str]) -> bool:
    """True when a split classifier leaves class-sharded logits, so the loss must run in ``loss_parallel``."""
    return any(v.startswith("colwise_sharded_output") for v in styles.values())


def apply_tp(model: nn.Module, tp_mesh, styles: Mapping[str, str]) -> None:
    """Shard ``model``'s submodules in place over ``tp_mesh`` per ``styles`` (from :func:`tp_styles`)."""
    if tp_mesh.size() == 1 or not styles:
        return
    plan = {path: TP_STYLES[style]() for path, style in styles.items() if TP_STYLES[style] is not None}
    if plan:
        parallelize_module(model, tp_mesh, plan)
