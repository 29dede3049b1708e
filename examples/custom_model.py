"""A user-defined model for Stratagem: ``--model py:examples/custom_model.py:build``.

The contract (README, "Plan your own model"): ``build()`` returns an ``nn.Module`` whose top-level children, in
registration order, are the layers a pipeline stage can hold, and whose ``forward`` runs them once each in that
order; ``input_spec`` declares one sample and the classes of the cross-entropy loss; ``tp_plan`` (optional) says
how each block type splits over tensor-parallel ranks.

Run it end to end on this machine::

    stratagem profile model --model py:examples/custom_model.py:build --analytic --cluster dgx-h100 --out prof.json
    stratagem plan --model py:examples/custom_model.py:build --model-profile prof.json --cluster dgx-h100 \\
        --gpus 16 --global-batch 64 --out plan.json
    stratagem show plan.json
"""

from __future__ import annotations

import torch
from torch import nn

FEATURES, HIDDEN, LAYERS, CLASSES = 32, 256, 6, 10


class Block(nn.Module):
    """Pre-norm residual MLP block: x + fc2(gelu(fc1(norm(x))))."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class ResidualMLP(nn.Module):
    # the input and loss Stratagem should use: one sample is FEATURES floats, the output has CLASSES logits
    input_spec = {"sample_shape": [FEATURES], "dtype": "float32", "num_classes": CLASSES}
    # per block type: Megatron's column- then row-parallel pair (optional; without it TP is not searched)
    tp_plan = {"Block": {"fc1": "colwise", "fc2": "rowwise"}}

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(FEATURES, HIDDEN)                                   # layer "proj"
        self.blocks = nn.ModuleList(Block(HIDDEN) for _ in range(LAYERS))         # layers "blocks.0" .. "blocks.5"
        self.out = nn.Linear(HIDDEN, CLASSES)                                     # layer "out"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def build() -> nn.Module:
    """Called by Stratagem under ``torch.device("meta")``: build the layers, leave the values to the runtime."""
    return ResidualMLP()
