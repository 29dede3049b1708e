"""Tensor (and sequence) parallelism applied to a module: the stage's TP plan (:mod:`runtime.executor.tp_plan`,
plain data: submodule path -> style name) mapped to torch.distributed.tensor.parallel styles by ``apply_tp``:

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

Replicated layers under ``tp > 1`` are Whale's replicas, each TP rank computing a batch slice; their gradients are
summed over the TP group by :class:`ReplicaGradSync` (and averaged over DP by the DP wrapper).
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


def apply_tp(model: nn.Module, tp_mesh, styles: Mapping[str, str]) -> None:
    """Shard ``model``'s submodules in place over ``tp_mesh`` per ``styles`` (from :func:`runtime.executor.tp_plan.tp_styles`)."""
    if tp_mesh.size() == 1 or not styles:
        return
    plan = {path: TP_STYLES[style]() for path, style in styles.items() if TP_STYLES[style] is not None}
    if plan:
        parallelize_module(model, tp_mesh, plan)
