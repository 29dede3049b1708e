"""Data parallelism per ZeRO stage: ``apply_dp``.

Mapping of the plan's ``zero_stage`` (Rajbhandari et al. 2020, "ZeRO", §5) onto torch building blocks:

| zero | ZeRO meaning | torch building block used here |
|---|---|---|
| 0 | plain data parallel | FSDP2-style ``replicate`` (torch.distributed._composable.replicate_with_fsdp) |
| 1 | shard optimizer state | ``fully_shard(reshard_after_forward=False)`` — same as 2 (see below) |
| 2 | + shard gradients | ``fully_shard(reshard_after_forward=False)`` |
| 3 | + shard parameters | ``fully_shard(reshard_after_forward=True)`` |

torch has no FSDP2 mode that shards optimizer state only: ZeRO-1 is run as ZeRO-2, which communicates
the same bytes (a reduce-scatter plus an all-gather equals one all-reduce, ZeRO §7.2.1) and uses less
memory. FSDP2 with ``reshard_after_forward=False`` also shards parameters *at rest* (between steps),
so ZeRO-1/2 here hold sharded parameters outside forward/backward; inside a step the memory is ZeRO-2's.
``replicate`` is used instead of DDP because it takes tensor-parallel DTensor parameters (DP x TP) and is
understood by torch.distributed.pipelining's stages.

Every dp mode averages gradients over the dp axis, so each replica's loss is scaled by its batch share
(``data.loss_scale``) to get the full-batch-mean gradient.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import fully_shard

ZERO_MAPPING = {
    0: "replicate",
    1: "fully_shard(reshard_after_forward=False)",
    2: "fully_shard(reshard_after_forward=False)",
    3: "fully_shard(reshard_after_forward=True)",
}


def apply_dp(
    model: nn.Module,
    dp_mesh,
    *,
    zero_stage: int,
    block_paths: Iterable[str],
    ignored_params: set[nn.Parameter] | None = None,
    mp_policy=None,
) -> str:
    """Wrap ``model`` (one pipeline chunk) for data parallelism over ``dp_mesh``; returns the mode used.

    Each block in ``block_paths`` present in ``model`` becomes its own FSDP unit (one all-gather per
    block, torchtitan's ``apply_fsdp``), then the chunk root collects the remaining parameters.
    A 1-rank dp mesh leaves the model untouched (``"none"``). ``ignored_params`` (an MoE's routed experts,
    reduced over their own group by ``runtime.executor.moe``) stay plain tensors outside the wrapper.
    ``mp_policy``: FSDP2's ``MixedPrecisionPolicy`` for ZeRO 1-3 (``runtime.executor.speed.fsdp_mp_policy``).
    """
    if dp_mesh.size() == 1:
        return "none"
    if zero_stage == 0:
        replicate(model, mesh=dp_mesh, ignored_params=ignored_params)
        return ZERO_MAPPING[0]
    reshard = zero_stage == 3
    extra = {"mp_policy": mp_policy} if mp_policy is not None else {}
    for path in block_paths:
        try:
            block = model.get_submodule(path)
        except AttributeError:
            continue
        if block is not None:
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=ignored_params, **extra)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=ignored_params, **extra)
    return ZERO_MAPPING[zero_stage]
