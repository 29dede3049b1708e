"""Deterministic, placement-independent weight init.

Every parameter and buffer draws from its own CPU generator seeded by ``crc32(f"{seed}:{path}")`` of its
module path, so the same seed gives the same values whether the model is whole or cut into pipeline
stages, built on CPU or materialized from meta with ``to_empty``. (Python's ``hash`` is salted per
process, hence crc32.)

Distributions: Linear/Embedding weights N(0, 0.02) and zero biases (GPT-2, Radford et al. 2019);
residual output projections (attn.proj, mlp.fc2, attn.wo, mlp.w2, and an MoE's expert and shared-expert w2)
N(0, 0.02/sqrt(2 * layers)) (GPT-2 §2.3);
convolutions N(0, 2/fan_out) (He et al. 2015, "kaiming normal, fan_out"); norms weight 1, bias 0;
BatchNorm running stats 0/1. A tied LM head takes the token embedding's values ("embed.tok.weight").
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from runtime.models.layered import LayeredModel

GPT2_INIT_STD = 0.02  # Radford et al. 2019 (GPT-2 code: initializer_range)
_RESIDUAL_OUT = ("attn.proj.weight", "mlp.fc2.weight", "attn.wo.weight", "mlp.w2.weight")


def _generator(seed: int, path: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{path}".encode()))


def _normal(shape: torch.Size, std: float, seed: int, path: str) -> torch.Tensor:
    return torch.randn(shape, generator=_generator(seed, path)) * std


def _num_blocks(model: nn.Module) -> int:
    # the full model's depth (a pipeline-cut model still knows it) so the residual scaling is stable
    return int(getattr(model, "num_layers", 0) or 1)


def _value(
    module: nn.Module, name: str, tensor: torch.Tensor, path: str, seed: int, layers: int
) -> torch.Tensor | None:
    """The init value of one parameter/buffer on CPU in float32 (None = leave it as it is)."""
    shape = tensor.shape
    if isinstance(module, (nn.LayerNorm, nn.BatchNorm2d)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm")):
        if name in ("weight", "running_var"):
            return torch.ones(shape)
        return torch.zeros(shape)  # bias, running_mean, num_batches_tracked
    if isinstance(module, nn.Conv2d):
        fan_out = shape[0] * math.prod(shape[2:])
        return _normal(shape, math.sqrt(2.0 / fan_out), seed, path)
    if name == "bias":
        return torch.zeros(shape)
    residual = path.endswith(_RESIDUAL_OUT) or (".moe." in path and path.endswith(".w2.weight"))
    std = GPT2_INIT_STD / math.sqrt(2 * layers) if residual else GPT2_INIT_STD
    return _normal(shape, std, seed, path)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> nn.Module:
    """Fill every parameter and buffer of ``model`` from ``seed`` by module path; returns ``model``.

    Tensors on the meta device are skipped (nothing to fill). Re-ties a tied LM head afterwards.

    >>> m = build_model(parse_model("gpt:tiny"), device="meta").to_empty(device="cpu")
    >>> init_weights(m, seed=0) is m
    True
    """
    tied = bool(getattr(model, "tie_embeddings", False))
    layers = _num_blocks(model)
    external_init = getattr(model, "external_init", None)  # hf: transformers' init of constant tensors
    done = external_init(model) if external_init is not None else set()
    for mod_path, module in model.named_modules():
        tensors = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        for name, tensor in tensors:
            if tensor is None or tensor.device.type == "meta":
                continue
            path = f"{mod_path}.{name}" if mod_path else name
            if path in done:
                continue
            if tied and path == "head.weight":
                path = "embed.tok.weight"
            value = _value(module, name, tensor, path, seed, layers)
            if value is not None:
                tensor.copy_(value.to(dtype=tensor.dtype))
    if isinstance(model, LayeredModel):
        tie_weights(model)
    return model


def tie_weights(model: LayeredModel) -> LayeredModel:
    """Make ``head.weight`` the token embedding's Parameter again when the model ties them and holds both.

    ``to_empty``/``to`` replace Parameters one module at a time, which unties shared weights; call this
    after materializing (``init_weights`` does). A pipeline stage holding only one of the two keeps its own
    copy with identical initial values; keeping the copies in sync is the runtime's job.
    """
    embed, head = getattr(model, "embed", None), getattr(model, "head", None)
    if getattr(model, "tie_embeddings", False) and embed is not None and head is not None:
        head.weight = embed.tok.weight
    return model
