"""Family dispatch: build a whole model or one top-level layer from a :class:`ModelSpec`."""

from __future__ import annotations

from typing import Callable, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from planner.core import StratagemError
from planner.model import ModelSpec
from runtime.models.cnn3d import (
    build_volume_layer,
    build_volume_model,
    volume_loss,
    volume_targets,
)
from runtime.models.dims import GPTDims, LlamaDims, MoEDims, ResNetDims, VolumeDims, resolve_dims
from runtime.models.external import build_external, build_external_layer, external, input_dtype
from runtime.models.gpt import build_gpt, build_gpt_layer
from runtime.models.layered import LayeredModel
from runtime.models.paths import check_layer_path
from runtime.models.llama import build_llama, build_llama_layer
from runtime.models.mlp import build_mlp, build_mlp_layer
from runtime.models.moe import build_moe, build_moe_layer
from runtime.models.resnet import build_resnet, build_resnet_layer

# family -> (whole-model builder, layer builder (dims, path, tp)); layer paths: runtime.models.paths
_FAMILIES = {
    "gpt": (build_gpt, build_gpt_layer),
    "llama": (build_llama, build_llama_layer),
    "moe": (build_moe, build_moe_layer),
    "resnet": (build_resnet, build_resnet_layer),
    "mlp": (build_mlp, build_mlp_layer),
    "unet3d": (build_volume_model, build_volume_layer),
    "cosmoflow": (build_volume_model, build_volume_layer),
}
SEQUENCE_FAMILIES = ("gpt", "llama", "moe", "hf")

DeviceLike = str | torch.device
M = TypeVar("M", bound=nn.Module)


def _materialized(module: M, device: DeviceLike, dtype: torch.dtype) -> M:
    """A meta-built module on ``device`` in ``dtype``; real devices get the seeded init (seed 0)."""
    if torch.device(device).type != "meta":
        from runtime.models.init import init_weights

        module.to_empty(device=device)
        init_weights(module, seed=0)
    return module.to(dtype=dtype)


def _custom_batch(
    spec: ModelSpec, micro_batch: int, *, device: DeviceLike, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs of the declared ``input_spec`` and class-id targets shaped like the output minus its last dim."""
    ext = external(spec)
    shape, target_shape = [micro_batch, *ext.inputs.sample_shape], [micro_batch, *ext.target_shape]
    ids = input_dtype(spec) == torch.long
    if torch.device(device).type == "meta":
        return (
            torch.empty(shape, device="meta", dtype=torch.long if ids else dtype),
            torch.empty(target_shape, device="meta", dtype=torch.long),
        )
    gen = torch.Generator().manual_seed(seed)
    inputs = (
        torch.randint(ext.inputs.vocab, shape, generator=gen) if ids else torch.randn(shape, generator=gen).to(dtype)
    )
    targets = torch.randint(ext.inputs.num_classes, target_shape, generator=gen)
    return inputs.to(device), targets.to(device)


def _built(build: Callable[[], M], device: DeviceLike, dtype: torch.dtype) -> M:
    with torch.device(device):
        module = build()
    return module.to(dtype=dtype)


def build_model(spec: ModelSpec, *, device: DeviceLike = "cpu", dtype: torch.dtype = torch.float32) -> LayeredModel:
    """Build the model ``spec`` describes on ``device`` ("cpu", "meta", ...) in ``dtype``.

    Weights on a real device come from PyTorch's default init; call :func:`init_weights` for the
    deterministic, placement-independent init (the runtime: build on meta, ``to_empty``, ``init_weights``).

    >>> build_model(parse_model("gpt:tiny")).layer_paths()[:2]
    ['embed', 'blocks.0']
    """
    if spec.is_external:
        return _materialized(build_external(spec), device, dtype)
    dims = resolve_dims(spec)
    return _built(lambda: _FAMILIES[spec.family][0](dims), device, dtype)  # type: ignore[operator]


def build_layer(
    spec: ModelSpec, path: str, tp: int = 1, *, device: DeviceLike = "cpu", dtype: torch.dtype = torch.float32
) -> nn.Module:
    """One top-level layer alone; ``tp`` > 1 gives one TP rank's shard (checks are in ``build_tp_shard``)."""
    check_layer_path(spec, path)
    if spec.is_external:
        return _materialized(build_external_layer(spec, path, tp), device, dtype)
    dims = resolve_dims(spec)
    return _built(lambda: _FAMILIES[spec.family][1](dims, path, tp), device, dtype)  # type: ignore[operator]


def loss_fn(spec: ModelSpec) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(output, target) -> scalar mean cross-entropy; for language models over every token."""
    if spec.family in SEQUENCE_FAMILIES:

        def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())

        return lm_loss
    if spec.family == "custom":  # class ids per output position (README: input_spec)

        def custom_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.flatten(0, -2).float(), target.flatten())

        return custom_loss
    if spec.family in ("unet3d", "cosmoflow"):
        return volume_loss(resolve_dims(spec))  # type: ignore[arg-type]

    def classifier_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), target)

    return classifier_loss


def sample_shape(spec: ModelSpec, seq_len: int) -> list[int]:
    """Shape of one input sample: [seq] token ids, [C, H, W] images, or [features]."""
    if spec.family == "hf":
        return [seq_len]
    if spec.family == "custom":
        return list(external(spec).inputs.sample_shape)
    dims = resolve_dims(spec)
    if isinstance(dims, (GPTDims, LlamaDims, MoEDims)):
        return [seq_len]
    if isinstance(dims, ResNetDims):
        return [dims.in_channels, dims.image_size, dims.image_size]
    if isinstance(dims, VolumeDims):
        return [int(spec.dim("in_channels")), *[int(spec.dim("volume"))] * 3]
    return [dims.in_features]


def num_classes(spec: ModelSpec) -> int:
    """Classes of the model's output: the vocabulary, ``num_classes`` or ``out_features``."""
    if spec.is_external:
        return external(spec).inputs.num_classes
    dims = resolve_dims(spec)
    if isinstance(dims, (GPTDims, LlamaDims, MoEDims)):
        return dims.vocab
    if isinstance(dims, VolumeDims):
        return int(spec.dim("num_classes" if spec.family == "unet3d" else "outputs"))
    return dims.num_classes if isinstance(dims, ResNetDims) else dims.out_features


def example_batch(
    spec: ModelSpec,
    micro_batch: int,
    seq_len: int,
    *,
    device: DeviceLike = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random (inputs, targets) batch of the right shapes and types, reproducible from ``seed``.

    Language models: token ids (b, s) and targets (b, s); classifiers: float inputs and targets (b,).
    """
    if spec.family == "custom":
        return _custom_batch(spec, micro_batch, device=device, dtype=dtype, seed=seed)
    shape = [micro_batch, *sample_shape(spec, seq_len)]
    is_lm = spec.is_language_model
    max_seq = (
        int(spec.dims.get("max_seq", seq_len))
        if spec.family == "hf"
        else getattr(resolve_dims(spec), "max_seq", seq_len)
    )
    if is_lm and seq_len > max_seq:
        raise StratagemError(
            f"sequence length {seq_len} exceeds {spec.name}'s max_seq={max_seq}; "
            f"use --seq <= {max_seq} or a larger max_seq"
        )
    target_shape = shape if is_lm else [micro_batch]
    if spec.family in ("unet3d", "cosmoflow"):
        gen = torch.Generator().manual_seed(seed)
        volumes = torch.randn(shape, generator=gen) if torch.device(device).type != "meta" else torch.zeros(1)
        if torch.device(device).type == "meta":
            target = [micro_batch, int(spec.dim("outputs"))] if spec.family == "cosmoflow" else [shape[0], *shape[2:]]
            dtype_t = torch.float32 if spec.family == "cosmoflow" else torch.long
            return torch.empty(shape, device="meta", dtype=dtype), torch.empty(target, device="meta", dtype=dtype_t)
        targets = volume_targets(resolve_dims(spec), volumes, gen)  # type: ignore[arg-type]
        return volumes.to(dtype).to(device), targets.to(device)
    if torch.device(device).type == "meta":
        inputs = torch.empty(shape, device="meta", dtype=torch.long if is_lm else dtype)
        return inputs, torch.empty(target_shape, device="meta", dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    inputs = (
        torch.randint(num_classes(spec), shape, generator=gen) if is_lm else torch.randn(shape, generator=gen).to(dtype)
    )
    targets = torch.randint(num_classes(spec), target_shape, generator=gen)
    return inputs.to(device), targets.to(device)
