"""The tensor-parallel plan of a pipeline stage as plain data, without torch: submodule path -> style name.

The plan says, per top-level module path, ``split`` (tensor-parallel on the ``tp`` axis) or
``replicate`` (Whale's two choices, Jia et al. ATC'22), and for split layers whether sequence
parallelism is on. For a split layer the zoo's ``tp_layout(spec, path)`` names the style of each
submodule (plain data); :func:`tp_styles` turns the whole model's layout into one plain dict, submodule path ->
style name, and :func:`runtime.executor.tp.apply_tp` maps the names to torch.distributed.tensor.parallel styles
(the table there). ``stratagem launch`` builds the dict of every stage before any process starts, so a layout the
runtime cannot run is one error line; for a zoo model that imports no torch (``hf:`` and ``py:`` models are built on
meta to read their layouts, which does).

Replicated layers under ``tp > 1`` are Whale's replicas: data-parallel INSIDE the TP group, each rank
computing a batch slice (B, a local ``(batch/tp, ...)`` tensor: ``Shard(0)`` of the micro-batch); their
gradients are summed over the TP group by :class:`runtime.executor.tp.ReplicaGradSync` (and averaged over DP by
the DP wrapper). Where the micro-batch does not split evenly over tp (one sample over two ranks), every TP rank
runs them on the whole micro-batch instead (R in and out; ``tp_styles(whole_batch_replicas=True)``), with nothing
to sum. A replica's output is made whole (``gather_batch_output``) where it leaves the stage or the model, so
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

from planner.core import StratagemError
from planner.model import ModelSpec
from planner.plan import LayerLayout, Plan
from runtime.models.paths import spec_layer_paths
from runtime.models.tp_layouts import tp_layout

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
    plan: dict[str, str] = {}
    keep = tuple(paths)
    order = spec_layer_paths(spec)
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


def uses_loss_parallel(styles: Mapping[str, str]) -> bool:
    """True when a split classifier leaves class-sharded logits, so the loss must run in ``loss_parallel``."""
    return any(v.startswith("colwise_sharded_output") for v in styles.values())
