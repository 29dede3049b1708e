"""Model specifications as plain data: a family name plus its dimensions.

The planner and the runtime share this one description of a model. The runtime builds a module from it
(``runtime.models.build_model``); the planner only reads its numbers. Presets are named sizes:
``gpt:tiny``, ``gpt:gpt3-175b``, ``llama:llama2-7b``, ``resnet:resnet50-wide``, ...

Sources of the preset sizes:
- GPT-2: Radford et al. 2019, Table 2 (layers, d_model); vocab 50257, context 1024.
- GPT-3 175B and the Megatron sizes: Narayanan et al. SC21 (arXiv:2104.04473) Table 1, vocab 51200,
  sequence 2048 (benchmarks/data/published_cases.csv). Megatron ties the LM head to the token embedding,
  which is how its parameter counts (e.g. 174.6B) are computed (SC21 eq. 2).
- Korthikanti et al. 2022 (arXiv:2205.05198) Table 3: 22B (48 layers, 6144 hidden, 64 heads), 530B, 1T.
- Megatron-LM README H100 table: vocab 131072, sequence 4096.
- Llama 2: Touvron et al. 2023, Table 1 / model cards (ffn 11008/13824/28672, 8 KV heads at 70B).
- ResNet-50: He et al. 2016, Table 1; the 100,000-class variant is the case Whale (Jia et al., ATC'22)
  splits while replicating the backbone.
- Mixture-of-Experts (family ``moe``): the config source of each preset is the comment above it in PRESETS.
- 3D U-Net and CosmoFlow (3D CNNs that spatial parallelism splits): sources and layer rules in
  ``planner/model/cnn3d.py``.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from planner.core import StratagemError
from planner.model.cnn3d import check_volume

Family = Literal["gpt", "llama", "moe", "resnet", "mlp", "unet3d", "cosmoflow", "hf", "custom"]
DimValue = int | float | bool
# families whose modules come from outside the zoo: a Hugging Face config, or the user's own function
EXTERNAL_FAMILIES = ("hf", "custom")


class Fidelity(BaseModel):
    """The fidelity check of an ``hf:`` model (``runtime.models.fidelity``): a tiny instance of its config built
    by transformers and by the wrapper the runtime trains, same weights, fp32; their largest logit difference."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_abs_logit_diff: float = Field(ge=0, description="largest |logit difference|, transformers vs the wrapper")
    tolerance: float = Field(gt=0, description="the largest difference that counts as the same model")
    layers: int = Field(ge=1, description="decoder layers of the tiny instance (one of each layer type)")
    transformers_version: str
    seconds: float = Field(ge=0, description="wall time of the check")


class ModelSpec(BaseModel):
    """A model as data. ``dims`` holds the family's constructor arguments (see ``FAMILY_DEFAULTS``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    family: Family
    preset: str | None = Field(None, description="preset name the dims came from, if any")
    dims: dict[str, DimValue] = Field(
        description="family constructor arguments, e.g. layers, hidden; for hf "
        "and custom models a read-only summary (layers, hidden, ...)"
    )
    source: str | None = Field(
        None,
        description="hf: the config.json it was read from; custom: 'py:FILE.py:FUNCTION' or 'module:pkg.mod:FUNCTION'",
    )
    config: dict[str, Any] | None = Field(
        None,
        description="hf: the whole config.json (the plan is self-contained: launch rebuilds the model from "
        "it); custom: {'sha256': of the file} for py: sources",
    )
    fidelity: Fidelity | None = Field(
        None, description="hf: the fidelity check's result (the wrapper computes transformers' logits)"
    )

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        if self.family in EXTERNAL_FAMILIES:  # sizes come from the config or function; read-only summary here
            return self
        unknown = sorted(set(self.dims) - set(FAMILY_DEFAULTS[self.family]))
        if unknown:
            raise ValueError(f"{self.family} models have no dimension(s) {unknown}")
        try:
            check_dims(self)
        except StratagemError as exc:  # inside a file: pydantic names the field
            raise ValueError(str(exc)) from None
        return self

    @property
    def name(self) -> str:
        """``family:preset`` when built from a preset, ``hf:<model_type>-layers..``, ``custom:FUNCTION``, else
        ``family:`` plus the dimensions that differ from the family defaults (``gpt:heads2-hidden32``)."""
        if self.family == "hf":
            return f"hf:{(self.config or {}).get('model_type', 'model')}-" + "-".join(
                f"{k}{self.dims[k]}" for k in ("layers", "hidden", "heads", "vocab") if k in self.dims
            )
        if self.family == "custom":
            return "custom:" + (self.source or "").rpartition(":")[2]
        if self.preset:
            return f"{self.family}:{self.preset}"
        defaults = FAMILY_DEFAULTS[self.family]
        tag = "-".join(f"{k}{v}" for k, v in sorted(self.dims.items()) if defaults.get(k) != v)
        return f"{self.family}:{tag}" if tag else self.family

    def dim(self, key: str) -> DimValue:
        """One dimension, with the family default where the spec leaves it out."""
        if key in self.dims:
            return self.dims[key]
        if self.family in EXTERNAL_FAMILIES:
            raise StratagemError(f"{self.name} has no dimension {key!r} (it has {', '.join(self.dims) or 'none'})")
        return FAMILY_DEFAULTS[self.family][key]

    @property
    def is_external(self) -> bool:
        """True for Hugging Face and user-defined models (built by ``runtime.models.external``)."""
        return self.family in EXTERNAL_FAMILIES

    @property
    def is_language_model(self) -> bool:
        """Token ids in, per-token logits out (gpt, llama, hf); the sequence length is a real dimension."""
        return self.family in ("gpt", "llama", "moe", "hf")

    @property
    def is_moe(self) -> bool:
        """A Mixture-of-Experts decoder of the zoo's ``moe`` family (router + experts in its FFNs)."""
        return self.family == "moe"


# Every dimension a family takes, with its default. A spec may override any of them.
FAMILY_DEFAULTS: dict[str, dict[str, DimValue]] = {
    "gpt": dict(layers=2, hidden=64, heads=4, ffn_hidden=0, vocab=256, max_seq=128, dropout=0.0, tie_embeddings=False),
    "llama": dict(
        layers=2,
        hidden=64,
        heads=4,
        kv_heads=0,
        ffn_hidden=0,
        vocab=256,
        max_seq=128,
        rope_theta=10000.0,
        tie_embeddings=False,
    ),
    # Llama-style decoder whose FFN (after the first dense_layers blocks) is a top-k router over `experts`
    # SwiGLU experts of width expert_ffn, plus shared_experts always-on experts of the same width.
    # capacity_factor 0 = dropless; aux_loss_coef: Switch/GShard load-balancing loss (Fedus et al. 2021 §2.2).
    "moe": dict(
        layers=2,
        hidden=64,
        heads=4,
        kv_heads=0,
        ffn_hidden=0,
        vocab=256,
        max_seq=128,
        rope_theta=10000.0,
        dropout=0.0,
        tie_embeddings=False,
        dense_layers=0,
        experts=4,
        top_k=2,
        expert_ffn=128,
        shared_experts=0,
        capacity_factor=0.0,
        aux_loss_coef=0.01,
    ),
    "resnet": dict(
        depths_0=3, depths_1=4, depths_2=6, depths_3=3, width=64, num_classes=1000, image_size=224, in_channels=3
    ),
    "mlp": dict(in_features=64, hidden=128, layers=4, out_features=10),
    # volume: voxels per side of the cubic input (planner/model/cnn3d.py)
    "unet3d": dict(volume=16, in_channels=1, num_classes=2, base_channels=4, levels=2),
    "cosmoflow": dict(
        volume=16, in_channels=4, base_channels=4, max_channels=0, conv_layers=2, kernel=3, fc1=16, fc2=8, outputs=4
    ),
}
# ffn_hidden 0 means 4*hidden (GPT) or the Llama rule; kv_heads 0 means heads (no grouped-query attention).

_MEGATRON = dict(vocab=51200, max_seq=2048, tie_embeddings=True)
_MEGATRON_H100 = dict(vocab=131072, max_seq=4096, tie_embeddings=True)

PRESETS: dict[str, dict[str, dict[str, DimValue]]] = {
    "gpt": {
        "tiny": dict(layers=2, hidden=64, heads=4, vocab=256, max_seq=128),
        "small": dict(layers=4, hidden=128, heads=4, vocab=512, max_seq=256),
        "gpt2": dict(layers=12, hidden=768, heads=12, vocab=50257, max_seq=1024, tie_embeddings=True),
        "gpt2-medium": dict(layers=24, hidden=1024, heads=16, vocab=50257, max_seq=1024, tie_embeddings=True),
        "gpt2-large": dict(layers=36, hidden=1280, heads=20, vocab=50257, max_seq=1024, tie_embeddings=True),
        "gpt2-xl": dict(layers=48, hidden=1600, heads=25, vocab=50257, max_seq=1024, tie_embeddings=True),
        # Megatron-LM SC21 Table 1
        "megatron-1.7b": dict(layers=24, hidden=2304, heads=24, **_MEGATRON),
        "megatron-3.6b": dict(layers=30, hidden=3072, heads=32, **_MEGATRON),
        "megatron-7.5b": dict(layers=36, hidden=4096, heads=32, **_MEGATRON),
        "megatron-18.4b": dict(layers=40, hidden=6144, heads=48, **_MEGATRON),
        "megatron-39.1b": dict(layers=48, hidden=8192, heads=64, **_MEGATRON),
        "megatron-76.1b": dict(layers=60, hidden=10240, heads=80, **_MEGATRON),
        "megatron-145.6b": dict(layers=80, hidden=12288, heads=96, **_MEGATRON),
        "megatron-310.1b": dict(layers=96, hidden=16384, heads=128, **_MEGATRON),
        "megatron-529.6b": dict(layers=105, hidden=20480, heads=128, **_MEGATRON),
        "megatron-1008b": dict(layers=128, hidden=25600, heads=160, **_MEGATRON),
        "gpt3-175b": dict(layers=96, hidden=12288, heads=96, **_MEGATRON),
        # Korthikanti et al. Table 3
        "korthikanti-22b": dict(layers=48, hidden=6144, heads=64, **_MEGATRON),
        "korthikanti-530b": dict(layers=105, hidden=20480, heads=128, **_MEGATRON),
        "korthikanti-1t": dict(layers=128, hidden=25600, heads=160, **_MEGATRON),
    },
    "llama": {
        "tiny": dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, max_seq=128),
        "llama2-7b": dict(layers=32, hidden=4096, heads=32, ffn_hidden=11008, vocab=32000, max_seq=4096),
        "llama2-13b": dict(layers=40, hidden=5120, heads=40, ffn_hidden=13824, vocab=32000, max_seq=4096),
        "llama2-70b": dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab=32000, max_seq=4096),
        # Llama 3 (Grattafiori et al. 2024, arXiv:2407.21783, Table 3): 8B and 70B, vocab 128,256, GQA with 8
        # KV heads; max_seq 131,072 after the long-context stage (§3.4.2)
        "llama3-8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=128256, max_seq=131072),
        "llama3-70b": dict(
            layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab=128256, max_seq=131072
        ),
    },
    "moe": {
        "tiny": dict(
            layers=2,
            hidden=64,
            heads=4,
            kv_heads=2,
            experts=4,
            top_k=2,
            expert_ffn=64,
            shared_experts=1,
            dense_layers=0,
            vocab=256,
            max_seq=128,
        ),
        # Mixtral-8x7B: HF config mistralai/Mixtral-8x7B-v0.1 (hidden_size 4096, intermediate_size 14336,
        # num_hidden_layers 32, num_attention_heads 32, num_key_value_heads 8, num_local_experts 8,
        # num_experts_per_tok 2, vocab_size 32000, rope_theta 1e6); Jiang et al. 2024 arXiv:2401.04088 Table 1.
        # Sequence 4096: the Megatron-Core MoE README's Mixtral-8x7B training recipe.
        "mixtral-8x7b": dict(
            layers=32,
            hidden=4096,
            heads=32,
            kv_heads=8,
            ffn_hidden=14336,
            vocab=32000,
            max_seq=4096,
            rope_theta=1e6,
            experts=8,
            top_k=2,
            expert_ffn=14336,
            aux_loss_coef=0.02,
        ),
        # Qwen3-30B-A3B: HF config Qwen/Qwen3-30B-A3B (hidden_size 2048, num_hidden_layers 48,
        # num_attention_heads 32, num_key_value_heads 4, num_experts 128, num_experts_per_tok 8,
        # moe_intermediate_size 768, vocab_size 151936, rope_theta 1e6, router_aux_loss_coef 0.001).
        # Approximation: Qwen3 uses head_dim 128 (q/o projections 2048 x 4096); here head dim is
        # hidden/heads = 64, so attention holds about half Qwen3's attention weights (-0.45B of 30.5B).
        "qwen3-30b-a3b": dict(
            layers=48,
            hidden=2048,
            heads=32,
            kv_heads=4,
            ffn_hidden=6144,
            vocab=151936,
            max_seq=4096,
            rope_theta=1e6,
            experts=128,
            top_k=8,
            expert_ffn=768,
            aux_loss_coef=0.001,
        ),
        # DeepSeek-V3: HF config deepseek-ai/DeepSeek-V3 and DeepSeek-AI 2024 arXiv:2412.19437 §4.2
        # (61 layers, hidden 7168, 128 heads, first_k_dense_replace 3 with intermediate_size 18432,
        # n_routed_experts 256, num_experts_per_tok 8, moe_intermediate_size 2048, n_shared_experts 1,
        # vocab_size 129280, sequence 4096 in pre-training, aux-loss-free balancing with a 1e-4
        # sequence-wise loss). Approximation: MLA is stated as standard multi-head attention of the same
        # shape (128 heads x 56 = 7168, no KV compression): 205M attention weights per layer vs MLA's 187M;
        # the multi-token-prediction module is left out.
        "deepseek-v3": dict(
            layers=61,
            hidden=7168,
            heads=128,
            kv_heads=128,
            ffn_hidden=18432,
            dense_layers=3,
            vocab=129280,
            max_seq=4096,
            rope_theta=10000.0,
            experts=256,
            top_k=8,
            expert_ffn=2048,
            shared_experts=1,
            aux_loss_coef=0.0001,
        ),
    },
    "resnet": {
        "tiny": dict(depths_0=1, depths_1=1, depths_2=1, depths_3=1, width=8, num_classes=10, image_size=32),
        "tiny-wide": dict(depths_0=1, depths_1=1, depths_2=1, depths_3=1, width=8, num_classes=1000, image_size=32),
        "resnet50": dict(num_classes=1000),
        "resnet50-wide": dict(num_classes=100_000),
    },
    "unet3d": {
        "tiny": dict(volume=16, in_channels=1, num_classes=2, base_channels=4, levels=2),
        # Cicek et al. 2016 Fig. 1: 4 levels, 32..256 channels (+512 bottom conv), 3 input channels, 3 classes;
        # 128^3 same-padded instead of the paper's 132x132x116 valid-padded input
        "cicek2016": dict(volume=128, in_channels=3, num_classes=3, base_channels=32, levels=4),
        # the case: single-channel 512^3 volumes (Oyama et al. TPDS 2021 train 3D U-Net on 256^3 and larger)
        "volume512": dict(volume=512, in_channels=1, num_classes=3, base_channels=32, levels=4),
    },
    "cosmoflow": {
        "tiny": dict(volume=16, in_channels=4, base_channels=4, conv_layers=2, kernel=3, fc1=16, fc2=8, outputs=4),
        # LBANN's CosmoFlow, the code Oyama et al. (TPDS 2021) trained (LLNL/lbann applications/physics/cosmology/
        # cosmoflow/cosmoflow_network_architectures.py): log2(volume) - 2 conv layers of min(base * 2^i, max)
        # channels, kernel 3; MLPerf HPC variant: base 32, max 512, dense 128/64, 4 outputs
        "mlperf": dict(
            volume=128,
            in_channels=4,
            base_channels=32,
            max_channels=512,
            conv_layers=5,
            kernel=3,
            fc1=128,
            fc2=64,
            outputs=4,
        ),
        # its non-MLPerf variant at 512^3 (base 16, max 256, dense 2048/256): 7 conv layers
        "volume512": dict(
            volume=512,
            in_channels=4,
            base_channels=16,
            max_channels=256,
            conv_layers=7,
            kernel=3,
            fc1=2048,
            fc2=256,
            outputs=4,
        ),
        "volume128": dict(
            volume=128,
            in_channels=4,
            base_channels=16,
            max_channels=256,
            conv_layers=5,
            kernel=3,
            fc1=2048,
            fc2=256,
            outputs=4,
        ),
    },
    "mlp": {
        "tiny": dict(in_features=32, hidden=64, layers=4, out_features=8),
        "small": dict(in_features=256, hidden=1024, layers=8, out_features=100),
    },
}
PRESETS["gpt"].update(
    {
        # Megatron-LM README H100 table (vocab 131072, sequence 4096)
        "megatron-h100-1.7b": dict(layers=24, hidden=2048, heads=16, **_MEGATRON_H100),
        "megatron-h100-7.1b": dict(layers=30, hidden=4096, heads=32, **_MEGATRON_H100),
        "megatron-h100-16b": dict(layers=32, hidden=6144, heads=48, **_MEGATRON_H100),
        "megatron-h100-32b": dict(layers=48, hidden=7168, heads=56, **_MEGATRON_H100),
        "megatron-h100-70b": dict(layers=84, hidden=8192, heads=64, **_MEGATRON_H100),
        "megatron-h100-119b": dict(layers=92, hidden=10240, heads=80, **_MEGATRON_H100),
        "megatron-h100-177b": dict(layers=96, hidden=12288, heads=96, **_MEGATRON_H100),
        "megatron-h100-314b": dict(layers=96, hidden=16384, heads=128, **_MEGATRON_H100),
        "megatron-h100-462b": dict(layers=112, hidden=18432, heads=144, **_MEGATRON_H100),
    }
)


def ffn_width(spec: ModelSpec) -> int:
    """The FFN width a decoder trains with: ``ffn_hidden``, or when 0 GPT's 4h (Radford et al.) and Llama's 2/3 of
    4h rounded up to a multiple of 256 (Touvron et al. 2023)."""
    f, h = int(spec.dim("ffn_hidden")), int(spec.dim("hidden"))
    if f:
        return f
    return 4 * h if spec.family == "gpt" else 256 * math.ceil(8 * h / 3 / 256)


def parse_model(text: str, **overrides: DimValue | None) -> ModelSpec:
    """Turn ``family`` or ``family:preset`` (plus dimension overrides) into a :class:`ModelSpec`.

    >>> parse_model("gpt:tiny").dims["layers"]
    2
    >>> parse_model("gpt", layers=96, hidden=12288, heads=96).dims["hidden"]
    12288
    """
    family, _, preset = text.partition(":")
    if family == "hf":
        return parse_hf(preset, **overrides)
    if family in ("py", "module"):
        _reject_overrides(text, overrides)
        return parse_custom(text)
    if family not in FAMILY_DEFAULTS:
        raise StratagemError(
            f"unknown model family {family!r}; choose one of {', '.join(sorted(FAMILY_DEFAULTS))}, "
            f"hf:CONFIG.json, py:FILE.py:FUNCTION or module:pkg.mod:FUNCTION (e.g. --model gpt:tiny)"
        )
    dims: dict[str, DimValue] = {}
    if preset:
        if preset not in PRESETS[family]:
            raise StratagemError(f"unknown {family} preset {preset!r}; choose one of {', '.join(PRESETS[family])}")
        dims.update(PRESETS[family][preset])
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in FAMILY_DEFAULTS[family]:
            raise StratagemError(
                f"{family} models have no dimension {key!r}; valid ones: {', '.join(FAMILY_DEFAULTS[family])}"
            )
        dims[key] = value
    try:
        return ModelSpec(family=family, preset=preset or None, dims=dims)
    except ValidationError as exc:
        raise StratagemError(str(exc.errors()[0]["msg"]).removeprefix("Value error, ")) from None


# Hugging Face config keys behind the zoo's dimension names (the same overrides work for hf: models).
# Sources: transformers LlamaConfig / GPT2Config attribute names and their attribute_map aliases.
HF_DIM_KEYS: dict[str, tuple[str, ...]] = {
    "layers": ("num_hidden_layers", "n_layer"),
    "hidden": ("hidden_size", "n_embd"),
    "heads": ("num_attention_heads", "n_head"),
    "kv_heads": ("num_key_value_heads",),
    "ffn_hidden": ("intermediate_size", "n_inner"),
    "vocab": ("vocab_size",),
    "max_seq": ("max_position_embeddings", "n_positions"),
    "tie_embeddings": ("tie_word_embeddings",),
}


def _reject_overrides(text: str, overrides: dict[str, DimValue | None]) -> None:
    given = sorted(k for k, v in overrides.items() if v is not None)
    if given:
        raise StratagemError(
            f"{text} is built by your function, which takes no size overrides "
            f"({', '.join('--' + k.replace('_', '-') for k in given)}); change the sizes in "
            f"the function instead"
        )


def load_hf_config(path_text: str) -> tuple[Path, dict[str, Any]]:
    """(config.json path, its contents) for ``PATH`` = a config.json or a folder holding one."""
    if not path_text:
        raise StratagemError("hf: needs a path, e.g. --model hf:llama3-8b/config.json or hf:FOLDER")
    path = Path(path_text).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise StratagemError(
            f"hf config {path} does not exist; pass a local config.json or a folder holding one "
            f"(no hub downloads: save it first with config.save_pretrained(FOLDER))"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StratagemError(
            f"hf config {path} is not readable JSON ({exc}); pass a config.json written by transformers"
        ) from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise StratagemError(
            f"hf config {path} has no 'model_type'; pass a config.json written by transformers "
            f"(e.g. LlamaConfig(...).save_pretrained(FOLDER))"
        )
    return path, config


def hf_dims(config: dict[str, Any]) -> dict[str, DimValue]:
    """The zoo-named sizes of an HF config (those it has), e.g. {"layers": 32, "hidden": 4096, ...}."""
    dims: dict[str, DimValue] = {}
    for dim, keys in HF_DIM_KEYS.items():
        value = next((config[k] for k in keys if config.get(k) is not None), None)
        if isinstance(value, (bool, int, float)):
            dims[dim] = value
    return dims


def parse_hf(path_text: str, **overrides: DimValue | None) -> ModelSpec:
    """``hf:PATH`` (plus zoo-named overrides mapped to the config's keys) as a self-contained spec.

    >>> parse_hf("tests/data/llama-tiny/config.json", layers=4).dims["layers"]  # doctest: +SKIP
    4
    """
    path, config = load_hf_config(path_text)
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in HF_DIM_KEYS:
            raise StratagemError(f"hf models have no override {key!r}; valid ones: {', '.join(HF_DIM_KEYS)}")
        target = next((k for k in HF_DIM_KEYS[key] if k in config), HF_DIM_KEYS[key][0])
        config[target] = value
    return ModelSpec(family="hf", dims=hf_dims(config), source=str(path.resolve()), config=config)


def parse_custom(text: str) -> ModelSpec:
    """``py:FILE.py:FUNCTION`` or ``module:pkg.mod:FUNCTION``; a py: file is pinned by its sha256."""
    kind, _, rest = text.partition(":")
    target, _, function = rest.rpartition(":")
    if not target or not function.isidentifier():
        example = "py:examples/custom_model.py:build" if kind == "py" else "module:mypkg.models:build"
        raise StratagemError(
            f"--model {text!r} must be {kind}:{'FILE.py' if kind == 'py' else 'pkg.mod'}:FUNCTION, e.g. {example}"
        )
    if kind == "module":
        return ModelSpec(family="custom", dims={}, source=f"module:{target}:{function}", config={})
    path = Path(target).expanduser()
    if not path.is_file():
        raise StratagemError(f"model file {path} does not exist; pass py:FILE.py:FUNCTION with an existing file")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return ModelSpec(family="custom", dims={}, source=f"py:{path.resolve()}:{function}", config={"sha256": digest})


# Dimensions that may be 0 (0 = the family's rule: ffn 4 x hidden, kv heads = heads, no channel cap) or are not
# counts.
_ZERO_MEANS_DEFAULT = frozenset({"ffn_hidden", "kv_heads", "dense_layers", "shared_experts", "max_channels"})
_NOT_COUNTS = frozenset({"dropout", "rope_theta", "tie_embeddings", "capacity_factor", "aux_loss_coef"})
# Largest sizes a spec may hold (the CLI's --layers / width bounds, planner/cli/common.py): a plan file with
# 10**30 layers made `show` run for minutes building its layer list.
MAX_DEPTH = 10_000  # layers, conv layers, U-Net levels
MAX_SIZE = 2**22  # every other count: hidden, heads, vocab, channels, voxels per side, ...
_DEPTHS = frozenset({"layers", "conv_layers", "levels"})


def check_dims(spec: ModelSpec) -> None:
    """Reject dimensions no model can have: counts < 1, dropout outside [0, 1), heads not dividing hidden.

    >>> check_dims(parse_model("gpt:tiny"))
    >>> parse_model("gpt:tiny", heads=3)
    Traceback (most recent call last):
    ...
    planner.core.errors.StratagemError: gpt hidden 64 is not divisible by heads 3; choose heads dividing hidden
    """
    if spec.is_external:
        return
    for key in FAMILY_DEFAULTS[spec.family]:
        value = spec.dim(key)
        if key in _NOT_COUNTS:
            continue
        low = 0 if key in _ZERO_MEANS_DEFAULT else 1
        high = MAX_DEPTH if key in _DEPTHS else MAX_SIZE
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise StratagemError(f"{spec.family} {key} {value!r} must be an integer in {low}..{high}; fix the size")
    dropout = spec.dims.get("dropout", 0.0)
    if not (isinstance(dropout, (int, float)) and 0 <= dropout < 1):
        raise StratagemError(f"dropout {dropout!r} must be a probability 0 <= p < 1")
    if spec.family in ("unet3d", "cosmoflow"):
        check_volume(spec)
    if spec.family in ("gpt", "llama", "moe"):
        hidden, heads = int(spec.dim("hidden")), int(spec.dim("heads"))
        if hidden % heads:
            raise StratagemError(
                f"{spec.family} hidden {hidden} is not divisible by heads {heads}; choose heads dividing hidden"
            )
        kv = int(spec.dims.get("kv_heads", 0) or 0)
        if kv and heads % kv:
            raise StratagemError(
                f"{spec.family} heads {heads} is not divisible by kv_heads {kv}; choose kv heads dividing heads"
            )
    if spec.family == "moe":
        check_moe_dims(spec)


def check_moe_dims(spec: ModelSpec) -> None:
    """The MoE rules: top_k <= experts, dense_layers <= layers, capacity_factor and aux_loss_coef >= 0.

    >>> parse_model("moe:tiny", top_k=5)
    Traceback (most recent call last):
    ...
    planner.core.errors.StratagemError: moe top_k 5 is more than its 4 experts; choose --top-k <= experts
    """
    experts, top_k = int(spec.dim("experts")), int(spec.dim("top_k"))
    if top_k > experts:
        raise StratagemError(f"moe top_k {top_k} is more than its {experts} experts; choose --top-k <= experts")
    layers, dense = int(spec.dim("layers")), int(spec.dim("dense_layers"))
    if dense > layers:
        raise StratagemError(
            f"moe dense_layers {dense} is more than its {layers} layers; choose dense_layers <= layers"
        )
    for key in ("capacity_factor", "aux_loss_coef"):
        value = spec.dim(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e6:
            raise StratagemError(f"moe {key} {value!r} must be a number >= 0 (capacity_factor 0 = dropless)")
