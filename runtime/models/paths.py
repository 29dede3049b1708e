"""Top-level layer paths of a model and their kinds, without torch: what ``stratagem show``, ``plan
--model-profile`` and ``launch`` check a plan or a profile against (importing torch costs those commands about 3 s).
Zoo models' paths follow from their dimensions; models from outside the zoo (``hf:``, ``py:``) are built on meta to
read theirs, which needs torch.

>>> spec_layer_paths(parse_model("gpt:tiny"))[:3]
['embed', 'blocks.0', 'blocks.1']
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.core import StratagemError
from planner.model import ModelSpec
from runtime.models.dims import GPTDims, LlamaDims, MLPDims, MoEDims, ResNetDims, VolumeDims, resolve_dims

if TYPE_CHECKING:
    from runtime.models.layered import LayeredModel


def decoder_paths(layers: int) -> list[str]:
    """Top-level layer paths of a decoder-only transformer (GPT, Llama, MoE), in forward order."""
    return ["embed", *(f"blocks.{i}" for i in range(layers)), "norm", "head"]


ZOO_FAMILIES = ("gpt", "llama", "moe", "resnet", "mlp", "unet3d", "cosmoflow")  # runtime.models.zoo builds these
# first path component -> LayerProfile.kind
_KINDS = {
    "embed": "embedding",
    "blocks": "block",
    "norm": "norm",
    "head": "head",
    "stem": "stem",
    "pool": "pool",
    "fc": "classifier",
    "out": "head",
    "dense": "linear",
}


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


def layer_paths(model_or_spec: LayeredModel | ModelSpec) -> list[str]:
    """Top-level layer paths in forward order: of a (possibly pipeline-cut) model, or of a spec's full model."""
    if isinstance(model_or_spec, ModelSpec):
        return spec_layer_paths(model_or_spec)
    return model_or_spec.layer_paths()


def layer_kind(path: str, spec: ModelSpec | None = None) -> str:
    """``LayerProfile.kind`` of a top-level path: embedding, block, norm, head, stem, pool or classifier
    (a custom model's layers: block inside a container, else layer)."""
    if spec is not None and spec.is_external:
        from runtime.models.external import external  # built on meta: imports torch

        check_layer_path(spec, path)
        return external(spec).kinds[path]
    try:
        return _KINDS[path.split(".")[0]]
    except KeyError:
        raise StratagemError(f"{path!r} is not a top-level layer path; use one of layer_paths(spec)") from None


def check_layer_path(spec: ModelSpec, path: str) -> None:
    paths = spec_layer_paths(spec)
    if path not in paths:
        shown = ", ".join(paths[:3] + (["...", paths[-1]] if len(paths) > 4 else paths[3:]))
        raise StratagemError(f"{spec.name} has no top-level layer {path!r}; its layers are {shown}")
