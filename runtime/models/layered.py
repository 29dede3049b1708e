"""The shape every zoo model shares: an ordered sequence of top-level layers addressed by module path.

Blocks live in an ``nn.ModuleDict`` keyed "0", "1", ... so paths read ``blocks.3`` and a pipeline stage
is cut by deleting entries (``del model.blocks["0"]``) or setting a top-level module to ``None``
(``model.embed = None``). ``forward`` skips absent modules, so a cut model accepts the previous stage's
activation instead of the raw input (torchtitan's pipeline style).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LayeredModel(nn.Module):
    """Top-level modules named in ``layer_names`` run in that order; ``None``/deleted ones are skipped."""

    layer_names: tuple[str, ...] = ()

    def __init__(self, layers: dict[str, nn.Module], *, tie_embeddings: bool = False) -> None:
        super().__init__()
        self.layer_names = tuple(layers)
        self.tie_embeddings = tie_embeddings
        blocks = layers.get("blocks")
        self.num_layers = len(blocks) if isinstance(blocks, nn.ModuleDict) else 0  # full depth, kept when cut
        for name, module in layers.items():
            setattr(self, name, module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in self.layer_names:
            module = getattr(self, name, None)
            if module is None:
                continue
            if isinstance(module, nn.ModuleDict):
                for block in module.values():
                    x = block(x)
            else:
                x = module(x)
        return x

    def layer_paths(self) -> list[str]:
        """Paths of the top-level layers still present, in forward order."""
        paths: list[str] = []
        for name in self.layer_names:
            module = getattr(self, name, None)
            if module is None:
                continue
            if isinstance(module, nn.ModuleDict):
                paths.extend(f"{name}.{key}" for key in module.keys())
            else:
                paths.append(name)
        return paths


def blocks_dict(blocks: list[nn.Module]) -> nn.ModuleDict:
    """``nn.ModuleDict`` keyed "0", "1", ... (so paths are ``blocks.i``)."""
    return nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})


class LMHead(nn.Linear):
    """``nn.Linear`` from the last hidden state to vocabulary logits.

    On CUDA, a vocabulary that is not a multiple of 64 (GPT-2's 50,257) makes a logits row stride cuBLAS's Hopper
    kernels cannot take (they need 16-byte-aligned leading dimensions), and cuBLAS falls back to an sm75 kernel:
    12.9 ms of gpt2-large's 66 ms step on one H200 (``benchmarks/data/h200``, the ``cutlass_75`` rows). There the
    weight is zero-padded to the next multiple of 64 for the matmul and the logits are sliced back to the
    vocabulary: the same values, with the parameter, its shape and its checkpoint keys unchanged. Elsewhere
    (CPU, a tensor-parallel DTensor shard) it is ``nn.Linear``."""

    ALIGN = 64
    pad_on = ("cuda",)  # device types that pad (a test sets "cpu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        pad = -rows % self.ALIGN
        if not pad or x.device.type not in self.pad_on or hasattr(self.weight, "to_local"):
            return super().forward(x)
        bias = None if self.bias is None else F.pad(self.bias, (0, pad))
        return F.linear(x, F.pad(self.weight, (0, 0, 0, pad)), bias)[..., :rows]


def build_decoder(dims, build_layer) -> LayeredModel:
    """A whole decoder from ``build_layer(dims, path)``; the head shares the token embedding's weight when
    ``dims.tie_embeddings``."""
    model = LayeredModel(
        {
            "embed": build_layer(dims, "embed"),
            "blocks": blocks_dict([build_layer(dims, f"blocks.{i}") for i in range(dims.layers)]),
            "norm": build_layer(dims, "norm"),
            "head": build_layer(dims, "head"),
        },
        tie_embeddings=dims.tie_embeddings,
    )
    if dims.tie_embeddings:
        model.get_submodule("head").weight = model.get_parameter("embed.tok.weight")
    return model
