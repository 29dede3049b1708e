"""Tensor parallelism as plain data: per top-level layer, which submodule is split how, and what it costs.

Styles (values of :func:`tp_layout`; keys are submodule paths relative to the layer, "" = the layer itself):
- "colwise": Linear split over output features (Megatron-LM SC21 §2.3, the first GEMM "A = [A1, A2]").
- "rowwise": Linear split over input features; partial outputs are all-reduced (the second GEMM).
- "vocab_embedding": embedding rows split by vocabulary; partial outputs all-reduced, output replicated.
- "colwise_sharded_output": head/classifier split over classes, output left sharded for a parallel loss.
- "sequence_parallel": norms (and dropout) that run on a sequence shard under sequence parallelism
  (Korthikanti et al. 2022 §4.2.2); without SP they are replicated.
A layout with no split style (empty, or only "sequence_parallel") means the layer is replicated.
"""

from __future__ import annotations

import torch
from torch import nn

from planner.core import StratagemError
from planner.model import ModelSpec
from planner.profile import CollectiveNeed
from runtime.models.dims import GPTDims, LlamaDims, MLPDims, MoEDims, ResNetDims, VolumeDims, resolve_dims
from runtime.models.external import external, external_collectives
from runtime.models.zoo import DeviceLike, build_layer, check_layer_path, layer_kind, num_classes

SPLIT_STYLES = ("colwise", "rowwise", "vocab_embedding", "colwise_sharded_output")
FP32_BYTES = 4  # the parallel cross-entropy exchanges fp32 per-token max / sum-exp / target logit

_GPT_BLOCK = {
    "ln1": "sequence_parallel",
    "attn.qkv": "colwise",
    "attn.proj": "rowwise",
    "ln2": "sequence_parallel",
    "mlp.fc1": "colwise",
    "mlp.fc2": "rowwise",
}
_LLAMA_BLOCK = {
    "ln1": "sequence_parallel",
    "attn.wq": "colwise",
    "attn.wk": "colwise",
    "attn.wv": "colwise",
    "attn.wo": "rowwise",
    "ln2": "sequence_parallel",
    "mlp.w1": "colwise",
    "mlp.w3": "colwise",
    "mlp.w2": "rowwise",
}
# an MoE block splits its attention and its shared experts (Megatron-Core's SharedExpertMLP is tensor-parallel
# like a dense MLP); the router is replicated and the routed experts are not split by the attention's tp
# (expert parallelism and expert TP, the plan's ep and etp, shard them instead: runtime.executor.moe)
_MOE_BLOCK = {k: v for k, v in _LLAMA_BLOCK.items() if not k.startswith("mlp.")}
_SHARED_EXPERTS = {"moe.shared.w1": "colwise", "moe.shared.w3": "colwise", "moe.shared.w2": "rowwise"}


def _block_layout(spec: ModelSpec, path: str) -> dict[str, str]:
    if spec.family == "gpt":
        return dict(_GPT_BLOCK)
    if spec.family == "moe":
        dims = resolve_dims(spec)
        assert isinstance(dims, MoEDims)
        if not dims.is_moe_block(int(path.split(".")[1])):
            return dict(_LLAMA_BLOCK)
        return {**_MOE_BLOCK, **(_SHARED_EXPERTS if dims.shared_experts else {})}
    return dict(_LLAMA_BLOCK)


def tp_layout(spec: ModelSpec, path: str) -> dict[str, str]:
    """Submodule path (relative to the layer) -> TP style for top-level layer ``path``.

    >>> tp_layout(parse_model("gpt:tiny"), "blocks.0")["attn.qkv"]
    'colwise'
    """
    check_layer_path(spec, path)
    if spec.is_external:
        return dict(external(spec).layouts.get(path, {}))
    kind = layer_kind(path)
    if spec.family in ("unet3d", "cosmoflow"):  # 3D CNNs split volumes (spatial parallelism), never weights
        return {}
    if spec.family in ("gpt", "llama", "moe"):
        if kind == "block":
            return _block_layout(spec, path)
        return {
            "embedding": {"tok": "vocab_embedding"},
            "norm": {"": "sequence_parallel"},
            "head": {"": "colwise_sharded_output"},
        }[kind]
    if kind in ("classifier", "head"):  # resnet fc, mlp out: Whale-style split classifier
        return {"": "colwise_sharded_output"}
    return {}


def is_splittable(spec: ModelSpec, path: str) -> bool:
    """True when the layer's layout splits weights (so tp > 1 shards differ from the full layer)."""
    return any(style in SPLIT_STYLES for style in tp_layout(spec, path).values())


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
    from runtime.models.zoo import example_batch, layer_paths

    x, _ = example_batch(spec, 1, seq_len, device="meta")
    if spec.family == "hf" and path != "embed":  # every later layer takes the (1, seq, hidden) hidden states
        return external_collectives(spec, path, torch.empty(1, seq_len, int(spec.dims["hidden"]), device="meta"), elem)
    model = external(spec).template
    for p in layer_paths(spec):
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
