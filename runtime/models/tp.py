"""Tensor parallelism per top-level layer: what the TP degree must divide, which collectives a split layer issues
(what it costs), and the shard one TP rank runs. Which submodule is split how (plain data, no torch):
:mod:`runtime.models.tp_layouts`.
"""

from __future__ import annotations

import torch
from torch import nn

from planner.core import StratagemError
from planner.model import ModelSpec
from planner.profile import CollectiveNeed
from runtime.models.dims import GPTDims, LlamaDims, MLPDims, MoEDims, ResNetDims, VolumeDims, resolve_dims
from runtime.models.external import external, external_collectives
from runtime.models.paths import check_layer_path, layer_kind, spec_layer_paths
from runtime.models.tp_layouts import is_splittable
from runtime.models.zoo import DeviceLike, build_layer, num_classes

FP32_BYTES = 4  # the parallel cross-entropy exchanges fp32 per-token max / sum-exp / target logit


def tp_constraints(spec: ModelSpec, path: str) -> dict[str, int]:
    """Dimensions the TP degree must divide for this layer, e.g. {"heads": 12, "ffn_hidden": 3072}."""
    if not is_splittable(spec, path):
        return {}
    if spec.is_external:
        return dict(external(spec).constraints.get(path, {}))
    dims = resolve_dims(spec)
    if layer_kind(path) == "block" and isinstance(dims, GPTDims):
        return {"heads": dims.heads, "ffn_hidden": dims.ffn_hidden}
    if layer_kind(path) == "block" and isinstance(dims, LlamaDims):
        return {"heads": dims.heads, "kv_heads": dims.kv_heads, "ffn_hidden": dims.ffn_hidden}
    if layer_kind(path) == "block" and isinstance(dims, MoEDims):
        attention = {"heads": dims.heads, "kv_heads": dims.kv_heads}
        if not dims.is_moe_block(int(path.split(".")[1])):
            return {**attention, "ffn_hidden": dims.ffn_hidden}
        shared = dims.shared_experts * dims.expert_ffn
        return {**attention, "shared_expert_ffn": shared} if shared else attention
    key = {"gpt": "vocab", "llama": "vocab", "moe": "vocab", "resnet": "num_classes", "mlp": "out_features"}[
        spec.family
    ]
    return {key: num_classes(spec)}


def check_tp(spec: ModelSpec, path: str, tp: int) -> None:
    """Raise :class:`StratagemError` unless ``tp`` divides every constraint of the layer."""
    if tp < 1:
        raise StratagemError(f"tensor-parallel degree {tp} must be a positive integer")
    if tp > 1 and not is_splittable(spec, path):
        note = external(spec).tp_note if spec.is_external else ""
        raise StratagemError(
            f"layer {path} of {spec.name} cannot be split by tensor parallelism"
            f"{' (' + note + ')' if note else ''}; replicate it (tp=1)"
        )
    for key, value in tp_constraints(spec, path).items():
        if value % tp:
            divisors = [d for d in range(1, value + 1) if value % d == 0 and d <= 64]
            raise StratagemError(
                f"tp={tp} does not divide {key}={value} of {spec.name} layer {path}; choose tp among {divisors}"
            )


def _need(op: str, phase: str, nbytes: float, count: int, sp: bool) -> CollectiveNeed:
    return CollectiveNeed(
        op=op,
        phase=phase,
        bytes_per_sample=float(nbytes),
        count=count,
        with_sequence_parallel=sp,
    )


def tp_collectives(
    spec: ModelSpec, path: str, seq_len: int, *, dtype: torch.dtype = torch.float32
) -> list[CollectiveNeed]:
    """Collectives the layer's TP layout issues at tp > 1, per sample (full, unsharded message sizes).

    Transformer block, without SP: 2 all-reduces of the s*h activation in forward (after attention and
    MLP, the "g" operators) and 2 in backward ("f") — Megatron-LM SC21 §2.3. With SP each all-reduce
    becomes an all-gather + reduce-scatter pair, forward and backward (Korthikanti et al. 2022 §4.2.2).
    Vocab embedding: forward all-reduce (SP: reduce-scatter; backward all-gather). Split head: backward
    all-reduce of the input gradient (SP: forward all-gather, backward reduce-scatter), plus the parallel
    cross-entropy's 3 fp32 all-reduces per token (max, target logit, sum of exp; Megatron-LM
    ``vocab_parallel_cross_entropy``).
    """
    check_layer_path(spec, path)
    if not is_splittable(spec, path):
        return []
    elem = torch.empty((), dtype=dtype).element_size()
    if spec.is_external:
        return _external_collectives(spec, path, seq_len, elem)
    dims = resolve_dims(spec)
    kind = layer_kind(path)
    if isinstance(dims, (ResNetDims, MLPDims)):  # split classifier: input gradient + one loss "token"
        features = dims.features if isinstance(dims, ResNetDims) else dims.hidden
        return [
            _need("all_reduce", "backward", features * elem, 1, False),
            _need("all_reduce", "forward", FP32_BYTES, 3, False),
        ]
    assert not isinstance(dims, VolumeDims), "3D CNNs never split weights (tp_layout: no splittable layer)"
    act = seq_len * dims.hidden * elem
    if kind == "block" and isinstance(dims, MoEDims) and dims.is_moe_block(int(path.split(".")[1])):
        # attention and shared experts as Megatron (one all-reduce each way, or all-gather + reduce-scatter
        # under SP). The routed experts' tokens (runtime.executor.moe TokenShard): without SP split over the
        # TP ranks and their outputs all-gathered (forward), the input gradient all-reduced (backward); with
        # SP each rank keeps its sequence shard and only the router's input is all-gathered (forward), its
        # gradient all-reduced (backward). The all-to-alls of expert parallelism are not TP collectives.
        n = 1 + (dims.shared_experts > 0)
        return [
            _need("all_reduce", "forward", act, n, False),
            _need("all_gather", "forward", act, 1, False),
            _need("all_reduce", "backward", act, n + 1, False),
            _need("all_gather", "forward", act, n + 1, True),
            _need("reduce_scatter", "forward", act, n, True),
            _need("all_gather", "backward", act, n, True),
            _need("reduce_scatter", "backward", act, n, True),
            _need("all_reduce", "backward", act, 1, True),
        ]
    if kind == "block":
        return [
            _need("all_reduce", "forward", act, 2, False),
            _need("all_reduce", "backward", act, 2, False),
            _need("all_gather", "forward", act, 2, True),
            _need("reduce_scatter", "forward", act, 2, True),
            _need("all_gather", "backward", act, 2, True),
            _need("reduce_scatter", "backward", act, 2, True),
        ]
    if kind == "embedding":
        return [
            _need("all_reduce", "forward", act, 1, False),
            _need("reduce_scatter", "forward", act, 1, True),
            _need("all_gather", "backward", act, 1, True),
        ]
    loss = [_need("all_reduce", "forward", seq_len * FP32_BYTES, 3, sp) for sp in (False, True)]
    return [
        _need("all_reduce", "backward", act, 1, False),
        _need("all_gather", "forward", act, 1, True),
        _need("reduce_scatter", "backward", act, 1, True),
        *loss,
    ]


def _external_collectives(spec: ModelSpec, path: str, seq_len: int, elem: int) -> list[CollectiveNeed]:
    """From one meta forward of the layer on its input (see ``runtime.models.external``)."""
    from runtime.models.zoo import example_batch

    x, _ = example_batch(spec, 1, seq_len, device="meta")
    if spec.family == "hf" and path != "embed":  # every later layer takes the (1, seq, hidden) hidden states
        return external_collectives(spec, path, torch.empty(1, seq_len, int(spec.dims["hidden"]), device="meta"), elem)
    model = external(spec).template
    for p in spec_layer_paths(spec):
        if p == path:
            break
        with torch.no_grad():
            x = model.get_submodule(p)(x)
    return external_collectives(spec, path, x, elem)


def build_tp_shard(
    spec: ModelSpec, path: str, tp: int, *, device: DeviceLike = "cpu", dtype: torch.dtype = torch.float32
) -> nn.Module:
    """A module computing exactly what ONE of ``tp`` ranks computes for layer ``path``.

    GPT block: heads/tp heads and ffn/tp MLP units with full LayerNorms (and full row-parallel biases);
    embedding: vocab/tp rows (masked lookup); head: vocab/tp output classes. ``tp=1`` is the full layer.
    """
    check_layer_path(spec, path)
    check_tp(spec, path, tp)
    return build_layer(spec, path, tp, device=device, dtype=dtype)
