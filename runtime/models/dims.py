"""A :class:`~planner.model.spec.ModelSpec` resolved into checked, typed dimensions per family.

``ffn_hidden`` 0 means 4*hidden for GPT (Radford et al. 2019 / Megatron-LM SC21 §2.3) and, for Llama,
2/3 of 4*hidden rounded up to a multiple of 256 (Touvron et al. 2023; Meta llama ``model.py``
``multiple_of=256``). ``kv_heads`` 0 means ``heads`` (no grouped-query attention).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from planner.core import StratagemError
from planner.model import FAMILY_DEFAULTS, SPATIAL_FAMILIES, ModelSpec, VolumeLayer, volume_layers

LLAMA_FFN_MULTIPLE = 256  # Meta llama model.py: ModelArgs.multiple_of


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTDims:
    layers: int
    hidden: int
    heads: int
    ffn_hidden: int
    vocab: int
    max_seq: int
    dropout: float
    tie_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True, kw_only=True, slots=True)
class LlamaDims:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    max_seq: int
    rope_theta: float
    tie_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True, kw_only=True, slots=True)
class ResNetDims:
    depths: tuple[int, int, int, int]
    width: int
    num_classes: int
    image_size: int
    in_channels: int

    @property
    def features(self) -> int:
        """Channels entering the classifier: width * 8 * expansion 4 (He et al. 2016, Table 1)."""
        return self.width * 8 * 4


@dataclass(frozen=True, kw_only=True, slots=True)
class VolumeDims:
    """A 3D CNN (unet3d, cosmoflow): its spec and layer table (``planner/model/cnn3d.py``)."""

    spec: ModelSpec
    layers: tuple[VolumeLayer, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class MLPDims:
    in_features: int
    hidden: int
    layers: int
    out_features: int


@dataclass(frozen=True, kw_only=True, slots=True)
class MoEDims:
    """The ``moe`` family: a Llama decoder whose FFN, after ``dense_layers`` dense blocks, is routed experts.

    ``capacity_factor`` 0 is dropless; ``shared_experts`` always-on experts run as one SwiGLU of width
    ``shared_experts * expert_ffn`` (DeepSeek-V3's ``DeepseekV3MoE.shared_experts``).
    """

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    max_seq: int
    rope_theta: float
    tie_embeddings: bool
    dense_layers: int = 0
    experts: int
    top_k: int
    expert_ffn: int
    shared_experts: int = 0
    capacity_factor: float = 0.0
    aux_loss_coef: float = 0.01

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def llama(self) -> LlamaDims:
        """The attention, norm and dense-FFN dimensions, as the ``llama`` family's pieces take them."""
        return LlamaDims(**{f.name: getattr(self, f.name) for f in fields(LlamaDims)})

    def is_moe_block(self, index: int) -> bool:
        """Block ``index`` (0-based) has a routed-expert FFN (the first ``dense_layers`` blocks are dense)."""
        return index >= self.dense_layers


Dims = GPTDims | LlamaDims | MoEDims | ResNetDims | MLPDims | VolumeDims


def _check_keys(spec: ModelSpec) -> None:
    unknown = sorted(set(spec.dims) - set(FAMILY_DEFAULTS[spec.family]))
    if unknown:
        raise StratagemError(
            f"{spec.family} models have no dimension(s) {', '.join(map(repr, unknown))}; "
            f"valid ones: {', '.join(FAMILY_DEFAULTS[spec.family])}"
        )


def _pos_int(spec: ModelSpec, key: str, *, allow_zero: bool = False) -> int:
    value = spec.dim(key)
    ok = isinstance(value, int) and not isinstance(value, bool) and (value >= 0 if allow_zero else value >= 1)
    if not ok:
        need = "a non-negative integer" if allow_zero else "a positive integer"
        raise StratagemError(f"{spec.name}: dimension {key}={value!r} must be {need}; fix the model spec")
    return int(value)


def _divides(spec: ModelSpec, small_key: str, small: int, big_key: str, big: int) -> None:
    if big % small:
        raise StratagemError(
            f"{spec.name}: {small_key}={small} does not divide {big_key}={big}; "
            f"choose {small_key} among the divisors of {big}"
        )


def llama_ffn_hidden(hidden: int) -> int:
    """SwiGLU width: int(2/3 * 4h) rounded up to a multiple of 256 (Meta llama model.py FeedForward)."""
    raw = int(2 * 4 * hidden / 3)
    return LLAMA_FFN_MULTIPLE * ((raw + LLAMA_FFN_MULTIPLE - 1) // LLAMA_FFN_MULTIPLE)


def resolve_dims(spec: ModelSpec) -> Dims:
    """Check ``spec`` and return its family's dimensions with every default applied.

    Raises :class:`StratagemError` for unknown keys, non-positive sizes, or heads not dividing hidden.
    """
    _check_keys(spec)
    if spec.family == "gpt":
        return _gpt(spec)
    if spec.family == "llama":
        return _llama(spec)
    if spec.family == "moe":
        return _moe(spec)
    if spec.family in SPATIAL_FAMILIES:
        for key in spec.dims:
            _pos_int(spec, key)
        return VolumeDims(spec=spec, layers=tuple(volume_layers(spec)))
    if spec.family == "resnet":
        d0, d1, d2, d3 = (_pos_int(spec, f"depths_{i}") for i in range(4))
        return ResNetDims(
            depths=(d0, d1, d2, d3),
            width=_pos_int(spec, "width"),
            num_classes=_pos_int(spec, "num_classes"),
            image_size=_pos_int(spec, "image_size"),
            in_channels=_pos_int(spec, "in_channels"),
        )
    return MLPDims(
        in_features=_pos_int(spec, "in_features"),
        hidden=_pos_int(spec, "hidden"),
        layers=_pos_int(spec, "layers"),
        out_features=_pos_int(spec, "out_features"),
    )


def _dropout(spec: ModelSpec) -> float:
    p = spec.dim("dropout")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
        raise StratagemError(f"{spec.name}: dropout={p!r} must be a probability in [0, 1); fix the model spec")
    return float(p)


def _gpt(spec: ModelSpec) -> GPTDims:
    hidden, heads = _pos_int(spec, "hidden"), _pos_int(spec, "heads")
    _divides(spec, "heads", heads, "hidden", hidden)
    ffn = _pos_int(spec, "ffn_hidden", allow_zero=True) or 4 * hidden
    return GPTDims(
        layers=_pos_int(spec, "layers"),
        hidden=hidden,
        heads=heads,
        ffn_hidden=ffn,
        vocab=_pos_int(spec, "vocab"),
        max_seq=_pos_int(spec, "max_seq"),
        dropout=_dropout(spec),
        tie_embeddings=bool(spec.dim("tie_embeddings")),
    )


def _llama(spec: ModelSpec) -> LlamaDims:
    hidden, heads = _pos_int(spec, "hidden"), _pos_int(spec, "heads")
    _divides(spec, "heads", heads, "hidden", hidden)
    kv = _pos_int(spec, "kv_heads", allow_zero=True) or heads
    _divides(spec, "kv_heads", kv, "heads", heads)
    ffn = _pos_int(spec, "ffn_hidden", allow_zero=True) or llama_ffn_hidden(hidden)
    return LlamaDims(
        layers=_pos_int(spec, "layers"),
        hidden=hidden,
        heads=heads,
        kv_heads=kv,
        ffn_hidden=ffn,
        vocab=_pos_int(spec, "vocab"),
        max_seq=_pos_int(spec, "max_seq"),
        rope_theta=float(spec.dim("rope_theta")),
        tie_embeddings=bool(spec.dim("tie_embeddings")),
    )


def _float_dim(spec: ModelSpec, key: str) -> float:
    value = spec.dim(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise StratagemError(f"{spec.name}: dimension {key}={value!r} must be a number >= 0; fix the model spec")
    return float(value)


def _moe(spec: ModelSpec) -> MoEDims:
    base = _llama(spec)
    experts, top_k = _pos_int(spec, "experts"), _pos_int(spec, "top_k")
    if top_k > experts:
        raise StratagemError(
            f"{spec.name}: top_k={top_k} exceeds experts={experts}; each token picks top_k distinct "
            f"experts, so choose top_k <= {experts}"
        )
    dense = _pos_int(spec, "dense_layers", allow_zero=True)
    if dense > base.layers:
        raise StratagemError(
            f"{spec.name}: dense_layers={dense} exceeds layers={base.layers}; choose at most {base.layers}"
        )
    return MoEDims(
        **{f.name: getattr(base, f.name) for f in fields(LlamaDims)},
        dense_layers=dense,
        experts=experts,
        top_k=top_k,
        expert_ffn=_pos_int(spec, "expert_ffn"),
        shared_experts=_pos_int(spec, "shared_experts", allow_zero=True),
        capacity_factor=_float_dim(spec, "capacity_factor"),
        aux_loss_coef=_float_dim(spec, "aux_loss_coef"),
    )
