"""Top-level layer paths of a model, without torch: what ``stratagem show`` and ``plan --model-profile`` check a
plan or a profile against (importing torch costs those commands about 3 s). Zoo models' paths follow from their
dimensions; models from outside the zoo (``hf:``, ``py:``) are built on meta to read theirs, which needs torch.

>>> spec_layer_paths(parse_model("gpt:tiny"))[:3]
['embed', 'blocks.0', 'blocks.1']
"""

from __future__ import annotations

from planner.model import ModelSpec
from runtime.models.dims import GPTDims, LlamaDims, MLPDims, MoEDims, ResNetDims, VolumeDims, resolve_dims


def decoder_paths(layers: int) -> list[str]:
    """Top-level layer paths of a decoder-only transformer (GPT, Llama, MoE), in forward order."""
    return ["embed", *(f"blocks.{i}" for i in range(layers)), "norm", "head"]


ZOO_FAMILIES = ("gpt", "llama", "moe", "resnet", "mlp", "unet3d", "cosmoflow")  # runtime.models.zoo builds these


def spec_layer_paths(spec: ModelSpec) -> list[str]:
    """Top-level layer paths of the full model ``spec`` describes, in forward order. ``KeyError``: a family this
    build's zoo does not have."""
    if spec.is_external:
        from runtime.models.external import external  # built on meta: imports torch

        return list(external(spec).paths)
    if spec.family not in ZOO_FAMILIES:
        raise KeyError(spec.family)
    dims = resolve_dims(spec)
    if isinstance(dims, GPTDims | LlamaDims | MoEDims):
        return decoder_paths(dims.layers)
    if isinstance(dims, ResNetDims):
        return ["stem", *(f"blocks.{i}" for i in range(sum(dims.depths))), "pool", "fc"]
    if isinstance(dims, MLPDims):
        return [*(f"blocks.{i}" for i in range(dims.layers)), "out"]
    if isinstance(dims, VolumeDims):
        return [layer.path for layer in dims.layers]
    raise KeyError(spec.family)
