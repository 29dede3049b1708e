"""The zoo ``moe`` dimensions of a Hugging Face MoE config (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3).

``hf:`` MoE configs run transformers' own blocks (``runtime.models.hf``), with expert parallelism over ep only
(``runtime.executor.hf_moe``). The same shapes as a zoo ``moe`` model get expert tensor parallelism, TP and a
capacity factor too; this maps a config.json's keys onto the ``moe`` family's
dimensions and lists what the zoo model does differently. Keys, from transformers' config classes
(``MixtralConfig``, ``Qwen2MoeConfig``, ``Qwen3MoeConfig``, ``DeepseekV3Config`` docstrings):

| moe dim | Mixtral | Qwen2-MoE / Qwen3-MoE | DeepSeek-V3 |
|---|---|---|---|
| experts | num_local_experts | num_experts (transformers 5 writes Qwen3's as num_local_experts) | n_routed_experts |
| top_k | num_experts_per_tok | num_experts_per_tok | num_experts_per_tok |
| expert_ffn | intermediate_size | moe_intermediate_size | moe_intermediate_size |
| ffn_hidden (dense blocks) | - | intermediate_size | intermediate_size |
| shared_experts | 0 | shared_expert_intermediate_size / moe_intermediate_size (Qwen2) | n_shared_experts |
| dense_layers | 0 | len(mlp_only_layers) when they lead (decoder_sparse_step 1) | first_k_dense_replace |
| aux_loss_coef | router_aux_loss_coef | router_aux_loss_coef | 0 (aux_loss_alpha when set) |
| capacity_factor | 0 (dropless) | 0 | 0 |
"""

from __future__ import annotations

from typing import Any

from planner.core import StratagemError
from planner.model import DimValue

_COMMON = {
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "vocab": "vocab_size",
    "max_seq": "max_position_embeddings",
    "rope_theta": "rope_theta",
    "tie_embeddings": "tie_word_embeddings",
}
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")


def _get(config: dict[str, Any], key: str, default: Any = None) -> Any:
    value = config.get(key)
    return default if value is None else value


def _dense_layers(config: dict[str, Any], layers: int, notes: list[str]) -> int:
    if config.get("first_k_dense_replace") is not None:  # DeepSeek-V3
        return int(config["first_k_dense_replace"])
    dense = sorted(int(i) for i in _get(config, "mlp_only_layers", []))
    step = int(_get(config, "decoder_sparse_step", 1))
    if dense != list(range(len(dense))) or step != 1:
        raise StratagemError(
            f"the config's dense layers (mlp_only_layers={dense}, decoder_sparse_step={step}) are not the leading "
            f"blocks, which is the only layout the zoo's moe family has; plan it as hf:"
        )
    if dense:
        notes.append(f"blocks 0..{len(dense) - 1} dense (mlp_only_layers)")
    return min(len(dense), layers)


def _shared(config: dict[str, Any], expert_ffn: int, notes: list[str]) -> int:
    if config.get("n_shared_experts") is not None:  # DeepSeek-V3
        return int(config["n_shared_experts"])
    width = int(_get(config, "shared_expert_intermediate_size", 0))
    if not width:
        return 0
    if width % expert_ffn:
        raise StratagemError(
            f"shared_expert_intermediate_size {width} is not a multiple of the expert width {expert_ffn}; "
            f"the zoo's moe family runs shared experts of the routed experts' width: plan it as hf:"
        )
    notes.append("Qwen2-MoE's sigmoid gate on the shared expert is not modelled (the zoo adds it ungated)")
    return width // expert_ffn


def moe_dims_from_hf(config: dict[str, Any]) -> tuple[dict[str, DimValue], list[str]]:
    """(``moe`` family dimensions, notes on what differs) of an HF MoE ``config`` (a config.json's dict).

    >>> dims, _ = moe_dims_from_hf({"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2,
    ...     "intermediate_size": 14336, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    ...     "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768})
    >>> dims["experts"], dims["expert_ffn"]
    (8, 14336)
    """
    experts_key = next((k for k in _EXPERTS if config.get(k) is not None), None)
    if experts_key is None:
        raise StratagemError(
            f"config model_type {config.get('model_type')!r} names no routed experts ({', '.join(_EXPERTS)}); "
            f"it is not a Mixture-of-Experts config"
        )
    notes: list[str] = []
    dims: dict[str, DimValue] = {k: config[v] for k, v in _COMMON.items() if config.get(v) is not None}
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in dims and rope.get("rope_theta") is not None:  # transformers 5 nests it
        dims["rope_theta"] = float(rope["rope_theta"])
    # Mixtral's experts are intermediate_size wide; the others have a separate moe_intermediate_size
    mixtral = config.get("moe_intermediate_size") is None
    expert_ffn = int(config["intermediate_size"] if mixtral else config["moe_intermediate_size"])
    dims.update(
        experts=int(config[experts_key]),
        top_k=int(config["num_experts_per_tok"]),
        expert_ffn=expert_ffn,
        shared_experts=_shared(config, expert_ffn, notes),
        dense_layers=_dense_layers(config, int(dims["layers"]), notes),
        aux_loss_coef=float(_get(config, "router_aux_loss_coef", _get(config, "aux_loss_alpha", 0.0))),
        capacity_factor=0.0,
    )
    if not mixtral and config.get("intermediate_size") is not None:
        dims["ffn_hidden"] = int(config["intermediate_size"])
    if config.get("norm_topk_prob") is False:
        notes.append(
            "the config keeps the top-k probabilities unnormalised (norm_topk_prob false); the zoo renormalises"
        )
    head_dim = config.get("head_dim")
    if head_dim is not None and int(head_dim) * int(dims["heads"]) != int(dims["hidden"]):
        notes.append(
            f"head_dim {head_dim} x {dims['heads']} heads != hidden {dims['hidden']}; the zoo uses hidden/heads"
        )
    if config.get("kv_lora_rank") is not None:
        notes.append("DeepSeek's multi-head latent attention is approximated by grouped-query attention")
    return dims, notes
