"""The shape every zoo model shares: an ordered sequence of top-level layers addressed by module path.

Blocks live in an ``nn.ModuleDict`` keyed "0", "1", ... so paths read ``blocks.3`` and a pipeline stage
is cut by deleting entries (``del model.blocks["0"]``) or setting a top-level module to ``None``
(``model.embed = None``). ``forward`` skips absent modules, so a cut model accepts the previous stage's
activation instead of the raw input (torchtitan's pipeline style).
"""

from __future__ import annotations

import torch
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


def decoder_paths(layers: int) -> list[str]:
    """Top-level layer paths of a decoder-only transformer (GPT, Llama), in forward order."""
    return ["embed", *(f"blocks.{i}" for i in range(layers)), "norm", "head"]


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
        model.head.weight = model.embed.tok.weight
    return model
