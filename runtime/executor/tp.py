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

Between top-level layers the activation is either replicated (R) or a sequence shard (S, a local
``(batch, seq/tp, hidden)`` tensor). A sequence-parallel block takes and returns S; everything else
takes and returns R (a split head takes either). Where neighbours disagree, R -> S is a
``scatter_sequence`` on the producer and S -> R a ``gather_sequence`` on the consumer, so each pipeline
stage applies exactly the conversions of the layers it holds. The GPT embedding adds position
embeddings after the token lookup, so its output is R (an all-reduce, not Megatron-SP's reduce-scatter).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)

from planner.errors import StratagemError
from planner.modelspec import ModelSpec
from planner.plan import LayerLayout

SEQ = Shard(1)  # (batch, seq, hidden): dim 1 is the sequence
TP_STYLES = {  # style name -> factory of the torch ParallelStyle (public: the overhead profiler uses it too)
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "rowwise_to_sequence": lambda: RowwiseParallel(output_layouts=SEQ),
    "gather_sequence": lambda: PrepareModuleInput(input_layouts=(SEQ,), desired_input_layouts=(Replicate(),),
                                                  use_local_output=True),
    "sequence_parallel": lambda: SequenceParallel(),
    "sequence_parallel_local": lambda: SequenceParallel(use_local_output=True),
    "scatter_sequence": lambda: PrepareModuleOutput(output_layouts=(Replicate(),), desired_output_layouts=(SEQ,),
                                                    use_local_output=True),
    "vocab_embedding": lambda: RowwiseParallel(input_layouts=Replicate()),
    "colwise_sharded_output": lambda: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    "colwise_sharded_output_from_sequence": lambda: ColwiseParallel(input_layouts=SEQ, output_layouts=Shard(-1),
                                                                    use_local_output=False),
}


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
    if spec.family not in ("gpt", "llama"):
        raise StratagemError(f"layer {path} of {spec.name} has no sequence dimension for sequence parallelism; "
                             f"re-plan without it")
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


def tp_styles(spec: ModelSpec, layout: Mapping[str, LayerLayout], paths: Sequence[str]) -> dict[str, str]:
    """Plain-data TP plan for the modules in ``paths`` (one pipeline stage, or the whole model):
    full submodule path -> style name (see the table above)."""
    from runtime.models import layer_paths

    plan: dict[str, str] = {}
    prev_out, prev_path = "R", None
    for path in layer_paths(spec):
        lay = layout.get(path)
        split = lay is not None and lay.style == "split"
        styles, want, out = _layer_styles(spec, path, bool(split and lay.sequence_parallel), prev_out) \
            if split else ({}, "R", "R")
        if prev_out == "R" and want == "S" and prev_path is not None:
            plan[prev_path] = "scatter_sequence"
        elif prev_out == "S" and want == "R":
            styles[path] = "gather_sequence"
        plan.update(styles)
        prev_out, prev_path = out, path
    keep = tuple(paths)
    return {k: v for k, v in plan.items() if any(k == p or k.startswith(p + ".") for p in keep)}


def uses_loss_parallel(styles: Mapping[str, str]) -> bool:
    """True when a split classifier leaves class-sharded logits, so the loss must run in ``loss_parallel``."""
    return any(v.startswith("colwise_sharded_output") for v in styles.values())


def apply_tp(model: nn.Module, tp_mesh, styles: Mapping[str, str]) -> None:
    """Shard ``model``'s submodules in place over ``tp_mesh`` per ``styles`` (from :func:`tp_styles`)."""
    if tp_mesh.size() == 1 or not styles:
        return
    parallelize_module(model, tp_mesh, {path: TP_STYLES[style]() for path, style in styles.items()})
