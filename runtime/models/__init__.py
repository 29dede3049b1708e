"""Model zoo: GPT, Llama, ResNet-50, MLP built from a :class:`planner.model.spec.ModelSpec`.

Every model is an ordered sequence of top-level layers addressed by module path (``embed``, ``blocks.3``,
``norm``, ``head``; ``stem``, ``blocks.i``, ``pool``, ``fc``; ``blocks.i``, ``out``). Tensor parallelism
is plain data per layer (:func:`tp_layout`, :func:`tp_constraints`, :func:`tp_collectives`) plus
:func:`build_tp_shard`, the module one TP rank runs, for profiling.

    spec = parse_model("gpt:tiny")
    model = build_model(spec, device="meta"); model.to_empty(device="cpu"); init_weights(model, seed=0)
    x, y = example_batch(spec, micro_batch=2, seq_len=32)
    loss_fn(spec)(model(x), y).backward()

Models from outside the zoo (``hf:`` configs, ``py:``/``module:`` functions) go through the same functions:
``runtime.models.external`` builds them on meta (``hf.py``: AutoModelForCausalLM, pieces found by structure;
``custom.py``: the README contract) and gives their layer paths, kinds and TP layouts as plain data.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# name -> the module that defines it, imported on first use: runtime.models.paths, .dims and .tp_layouts need no
# torch (for zoo models), so a command that only checks layer paths or TP layouts (show, plan --model-profile,
# launch) does not pay torch's import
_HOMES = {
    "resolve_dims": "runtime.models.dims",
    "init_weights": "runtime.models.init",
    "tie_weights": "runtime.models.init",
    "LayeredModel": "runtime.models.layered",
    **dict.fromkeys(("layer_kind", "layer_paths"), "runtime.models.paths"),
    **dict.fromkeys(("SPLIT_STYLES", "is_splittable", "tp_layout"), "runtime.models.tp_layouts"),
    **dict.fromkeys(("build_tp_shard", "check_tp", "tp_collectives", "tp_constraints"), "runtime.models.tp"),
    **dict.fromkeys(
        ("build_layer", "build_model", "example_batch", "loss_fn", "num_classes", "sample_shape"),
        "runtime.models.zoo",
    ),
}

if TYPE_CHECKING:
    from runtime.models.dims import resolve_dims
    from runtime.models.init import init_weights, tie_weights
    from runtime.models.layered import LayeredModel
    from runtime.models.paths import layer_kind, layer_paths
    from runtime.models.tp import build_tp_shard, check_tp, tp_collectives, tp_constraints
    from runtime.models.tp_layouts import SPLIT_STYLES, is_splittable, tp_layout
    from runtime.models.zoo import (
        build_layer,
        build_model,
        example_batch,
        loss_fn,
        num_classes,
        sample_shape,
    )


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


__all__ = [
    "LayeredModel",
    "SPLIT_STYLES",
    "build_layer",
    "build_model",
    "build_tp_shard",
    "check_tp",
    "example_batch",
    "init_weights",
    "is_splittable",
    "layer_kind",
    "layer_paths",
    "loss_fn",
    "num_classes",
    "resolve_dims",
    "sample_shape",
    "tie_weights",
    "tp_collectives",
    "tp_constraints",
    "tp_layout",
]
