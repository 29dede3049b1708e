"""Tensor parallelism as plain data, without torch: per top-level layer, which submodule is split how.

Styles (values of :func:`tp_layout`; keys are submodule paths relative to the layer, "" = the layer itself):
- "colwise": Linear split over output features (Megatron-LM SC21 §2.3, the first GEMM "A = [A1, A2]").
- "rowwise": Linear split over input features; partial outputs are all-reduced (the second GEMM).
- "vocab_embedding": embedding rows split by vocabulary; partial outputs all-reduced, output replicated.
- "colwise_sharded_output": head/classifier split over classes, output left sharded for a parallel loss.
- "sequence_parallel": norms (and dropout) that run on a sequence shard under sequence parallelism
  (Korthikanti et al. 2022 §4.2.2); without SP they are replicated.
A layout with no split style (empty, or only "sequence_parallel") means the layer is replicated.

Zoo models' layouts follow from their family and dimensions, so ``stratagem launch`` checks a plan's TP layout
without importing torch; models from outside the zoo (``hf:``, ``py:``) are built on meta to find theirs, which
needs torch. What the layouts cost and the shard one TP rank runs: :mod:`runtime.models.tp`.
"""

from __future__ import annotations

from planner.model import ModelSpec
from runtime.models.dims import MoEDims, resolve_dims
from runtime.models.paths import check_layer_path, layer_kind

SPLIT_STYLES = ("colwise", "rowwise", "vocab_embedding", "colwise_sharded_output")

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
        from runtime.models.external import external  # built on meta: imports torch

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
