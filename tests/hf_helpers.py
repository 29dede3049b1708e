"""Small Hugging Face configs written with transformers' config classes (no hub access), for the hf: tests."""

from __future__ import annotations

from pathlib import Path

from transformers import GemmaConfig, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

# A tiny Llama-architecture config: GQA (4 query heads, 2 KV heads), SwiGLU width 176, untied head.
TINY_LLAMA = dict(
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=128,
)

# Llama 3 shapes: Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3 (layers, model dimension, FFN
# dimension, attention / key-value heads, vocabulary 128,256, RoPE base 500,000), as in the
# meta-llama/Meta-Llama-3-8B and -70B config.json files (max_position_embeddings 8192, rms_norm_eps 1e-5).
LLAMA3 = dict(
    vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False
)
LLAMA3_8B = dict(
    LLAMA3,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
)
LLAMA3_70B = dict(
    LLAMA3,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
)


# Tiny MoE configs: 4 experts, top-2, expert width 48 (Qwen2-MoE adds a shared expert of width 96).
TINY_MOE = {
    "mixtral": dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        moe_intermediate_size=48, shared_expert_intermediate_size=96, num_experts=4, num_experts_per_tok=2
    ),
    "qwen3_moe": dict(moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2, head_dim=16),
}


def write_moe_config(folder: Path, kind: str, **overrides) -> Path:
    """Save a tiny Mixtral / Qwen2-MoE / Qwen3-MoE config into ``folder``; returns the config.json path."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    cls = {"mixtral": MixtralConfig, "qwen2_moe": Qwen2MoeConfig, "qwen3_moe": Qwen3MoeConfig}[kind]
    cls(**{**TINY_LLAMA, **TINY_MOE[kind], **overrides}).save_pretrained(folder)
    return Path(folder) / "config.json"


def write_config(folder: Path, kind: str = "llama", **overrides) -> Path:
    """Save a config of ``kind`` (llama, qwen2, mistral, gemma, gpt2) into ``folder``; returns the config.json path."""
    if kind == "llama":
        config = LlamaConfig(**{**TINY_LLAMA, **overrides})
    elif kind == "qwen2":
        config = Qwen2Config(**{**TINY_LLAMA, **overrides})
    elif kind == "gemma":  # scaled embedding (a buffer) and 1 + weight RMSNorms
        config = GemmaConfig(**{**TINY_LLAMA, "head_dim": 16, **overrides})
    elif kind == "mistral":  # a 4-token sliding window, so the 12-token tests see it
        config = MistralConfig(**{**TINY_LLAMA, "sliding_window": 4, **overrides})
    else:
        config = GPT2Config(
            **{
                **dict(
                    n_embd=64,
                    n_layer=2,
                    n_head=4,
                    vocab_size=256,
                    n_positions=128,
                    embd_pdrop=0.0,
                    attn_pdrop=0.0,
                    resid_pdrop=0.0,
                    bos_token_id=0,
                    eos_token_id=0,
                ),
                **overrides,
            }
        )
    config.save_pretrained(folder)
    return Path(folder) / "config.json"
