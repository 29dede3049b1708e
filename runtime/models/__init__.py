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

from runtime.models.dims import resolve_dims
from runtime.models.init import init_weights, tie_weights
from runtime.models.layered import LayeredModel
from runtime.models.tp import (
    SPLIT_STYLES,
    build_tp_shard,
    check_tp,
    is_splittable,
    tp_collectives,
    tp_constraints,
    tp_layout,
)
from runtime.models.zoo import (
    build_layer,
    build_model,
    example_batch,
    layer_kind,
    layer_paths,
    loss_fn,
    num_classes,
    sample_shape,
)

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
