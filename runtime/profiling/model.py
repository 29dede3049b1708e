"""Profile a model layer by layer into a :class:`planner.profile.load.ModelProfile`.

Method (measured): build each top-level layer alone (``runtime.models.build_layer``) and run it standalone
on a saved copy of its input, i.e. the previous layer's output (float inputs of every layer but the first
require grad, as inside the model). Per layer: FLOPs with ``FlopCounterMode``; bytes saved for backward
with ``saved_tensors_hooks`` (see ``runtime.profiling.measure``); forward and backward wall time after
warm-up at each micro-batch. TP-splittable layers are also profiled as one rank's shard
(``build_tp_shard``) at each requested degree. An MoE block's shards are measured without its routed experts,
which the layer describes instead (``ExpertProfile``) for the planner to cost per expert layout
(``runtime.profiling.experts``). Layers with equal signatures (class, parameter shapes,
input shape; e.g. every GPT block) are profiled once and the result copied. The model's last layer (LM
head, classifier) is profiled together with the loss (``WithLoss``), whose fp32 log-softmax it saves.

Analytic: the same on the meta device (no allocation); times = FLOPs / the cluster's achieved FLOP/s.

Replicated saved bytes follow saved(t) = R + S/t (Korthikanti et al. 2022, Table 2: LayerNorm inputs and
dropout masks do not shrink with t), fitted from the tp=1 and the smallest tp>1 shard.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from planner import __version__
from planner.core import StratagemError
from planner.model import ModelSpec
from planner.profile import LayerProfile, LayerTiming, ModelProfile, Provenance, ShardProfile
from runtime.models import (
    build_layer,
    build_tp_shard,
    check_tp,
    example_batch,
    init_weights,
    is_splittable,
    layer_kind,
    layer_paths,
    loss_fn,
    sample_shape,
    tp_collectives,
    tp_constraints,
)
from runtime.models.cnn3d import layer_input
from runtime.models.dims import resolve_dims
from runtime.models.external import external
from runtime.models.zoo import SEQUENCE_FAMILIES
from runtime.profiling.experts import expert_fields, without_routed_experts
from runtime.profiling.measure import (
    backward_working_set,
    count_flops,
    derived_timing,
    make_input,
    saved_bytes,
    time_layer,
)
from runtime.profiling.overhead import (
    measure_runtime_overhead,
    reference_matmul_figure,
    reference_matmul_rates,
    single_rank_group,
)

log = logging.getLogger(__name__)

TORCH_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_TP_STYLES = {"block": "megatron_block", "embedding": "vocab_parallel", "head": "column", "classifier": "column"}
LOSS_BYTES = 4.0  # fp32 loss scalar


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileSettings:
    """What to measure: sizes, dtype, device, and either timing repeats or a derived throughput."""

    micro_batches: tuple[int, ...]
    seq_len: int
    dtype: str
    tp_degrees: tuple[int, ...]
    device: str = "cpu"  # "meta" for --analytic
    warmup: int = 2
    repeats: int = 5
    achieved_flops_per_s: float | None = None  # set => times derived from FLOPs (analytic)


def torch_dtype(name: str) -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise StratagemError(f"dtype {name!r} cannot be profiled; use one of {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


def check_settings(spec: ModelSpec, settings: ProfileSettings) -> None:
    """Fail fast (before any work) on a TP degree that a transformer block cannot take."""
    torch_dtype(settings.dtype)
    _check_batch_norm(spec, min(settings.micro_batches))
    for path in layer_paths(spec):
        if layer_kind(path, spec) == "block" and is_splittable(spec, path):
            for tp in settings.tp_degrees:
                check_tp(spec, path, tp)
            return


def _check_batch_norm(spec: ModelSpec, micro_batch: int) -> None:
    """Training-mode BatchNorm needs more than one value per channel in the last (smallest) feature map."""
    if spec.family != "resnet":
        return
    side = int(spec.dim("image_size"))
    for _ in range(5):  # stem conv, max-pool and three strided stages each halve (rounding up)
        side = -(-side // 2)
    if micro_batch * side * side <= 1:
        raise StratagemError(
            f"{spec.name} cannot train with micro-batch {micro_batch}: its last feature maps are "
            f"{side}x{side}, so BatchNorm sees one value per channel; use --micro-batch >= 2"
        )


def _signature(module: nn.Module, x: torch.Tensor) -> str:
    """Equal for layers that compute the same thing: class, repr (strides...), parameter and input shapes."""
    shapes = [(n, tuple(p.shape)) for n, p in module.named_parameters()]
    text = f"{module!r}|{shapes}|{tuple(x.shape[1:])}|{x.dtype}|{getattr(module, 'p_drop', None)}"
    return f"{type(module).__name__}-{hashlib.sha1(text.encode()).hexdigest()[:12]}"


def _params(module: nn.Module) -> tuple[int, int]:
    unique = {id(p): p for p in module.parameters()}.values()
    return sum(p.numel() for p in unique), sum(p.numel() * p.element_size() for p in unique)


def _timings(
    module: nn.Module, x_full: torch.Tensor, first: bool, fwd_flops: float, bwd_flops: float, s: ProfileSettings
) -> list[LayerTiming]:
    """Timings per micro-batch; FLOPs are per sample (used only when times are derived)."""
    if s.device == "meta" and not s.achieved_flops_per_s:
        return []  # nothing to time on meta and no throughput to derive times from
    out = []
    for b in s.micro_batches:
        if s.achieved_flops_per_s:
            fwd = derived_timing(fwd_flops * b, s.achieved_flops_per_s)
            bwd = derived_timing(bwd_flops * b, s.achieved_flops_per_s)
        else:
            x = make_input(x_full[:b], needs_grad=not first)
            fwd, bwd = time_layer(module, x, warmup=s.warmup, repeats=s.repeats)
        out.append(LayerTiming(micro_batch=b, forward=fwd, backward=bwd))
    return out


class WithLoss(nn.Module):
    """The last layer followed by the loss, so its profile holds the loss's saved logits (fp32 log-softmax).

    On a TP shard the loss runs on the local logits: the memory and compute of Megatron's vocab-parallel
    cross-entropy for that rank (its three small all-reduces are in the layer's collectives).
    """

    def __init__(self, layer: nn.Module, spec: ModelSpec, targets: torch.Tensor) -> None:
        super().__init__()
        self.layer, self.loss, self.targets = layer, loss_fn(spec), targets

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.layer(x)
        return self.loss(logits, self.targets[: x.shape[0]] % logits.shape[-1])


@dataclass(frozen=True, kw_only=True, slots=True)
class _Layer:
    """One top-level layer to profile: its saved input (largest micro-batch) and how to build it."""

    spec: ModelSpec
    path: str
    x_full: torch.Tensor
    first: bool  # the model's first layer: its input needs no gradient
    targets: torch.Tensor | None  # set for the model's last layer: profile it with the loss

    def module(self, tp: int, s: ProfileSettings) -> nn.Module:
        layer = build_tp_shard(self.spec, self.path, tp, device=s.device, dtype=torch_dtype(s.dtype))
        if s.device != "meta":
            init_weights(layer, seed=0)  # deterministic values: no NaN/denormal timing artefacts
        without_routed_experts(layer)  # an MoE block's shard: the planner costs the routed experts per ep/etp
        return layer if self.targets is None else WithLoss(layer, self.spec, self.targets)

    @property
    def tied_head(self) -> bool:
        # SC21 eq. 2 counts a tied head's weight once, in the embedding (as planner.profile.gpt does)
        return self.path == "head" and bool(self.spec.dims.get("tie_embeddings", False))


def _shard(job: _Layer, tp: int, s: ProfileSettings) -> ShardProfile:
    """Profile one module (the full layer at tp=1, else one rank's shard) on the saved input."""
    module = job.module(tp, s)
    b0 = s.micro_batches[0]
    flops = count_flops(module, make_input(job.x_full[:b0], needs_grad=not job.first))
    saved = saved_bytes(module, make_input(job.x_full[:b0], needs_grad=not job.first), seq_len=s.seq_len)
    working = backward_working_set(module, make_input(job.x_full[:b0], needs_grad=not job.first))
    params, param_bytes = (0, 0) if job.tied_head else _params(module)
    fwd_flops, bwd_flops = flops.forward / b0, flops.backward / b0
    return ShardProfile(
        tp=tp,
        params=params,
        param_bytes=param_bytes,
        fwd_flops_per_sample=fwd_flops,
        bwd_flops_per_sample=bwd_flops,
        attention_scores_flops_per_sample=flops.forward_scores / b0,
        saved_bytes_per_sample=saved.total_bytes / b0,
        saved_attention_scores_bytes_per_sample=saved.attention_scores_bytes / b0,
        backward_ws_bytes_per_sample=working / b0,
        logits_bytes_per_sample=_logits_bytes(module, make_input(job.x_full[:b0], needs_grad=False)) / b0,
        timings=_timings(module, job.x_full, job.first, fwd_flops, bwd_flops, s),
        time_origin="derived" if s.achieved_flops_per_s else "measured",
    )


def _logits_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the last layer's output before the loss (0 for a layer profiled without one)."""
    if not isinstance(module, WithLoss):
        return 0
    with torch.no_grad():
        out = module.layer(x)
    return out.numel() * out.element_size()


def _fit_replicated(full: ShardProfile, shard: ShardProfile | None) -> float:
    """R in saved(t) = R + S/t from saved(1) and saved(t); no shard => everything but the attention scores is
    replicated. The scores are never part of R: they are their own term (``saved_attention_scores_bytes``), split by
    heads, and R + scores must not exceed what was saved (counted twice otherwise)."""
    not_scores = full.saved_bytes_per_sample - full.saved_attention_scores_bytes_per_sample
    if shard is None:
        return not_scores
    t = shard.tp
    replicated = (t * shard.saved_bytes_per_sample - full.saved_bytes_per_sample) / (t - 1)
    return min(max(replicated, 0.0), not_scores, shard.saved_bytes_per_sample)


def _fit_degree(spec: ModelSpec, path: str, degrees: tuple[int, ...]) -> int | None:
    """Smallest requested tp>1 for the fit, else the smallest divisor > 1 of the layer's constraints."""
    requested = [t for t in degrees if t > 1]
    if requested:
        return requested[0]
    limits = list(tp_constraints(spec, path).values())
    return next((t for t in range(2, min(limits) + 1) if all(v % t == 0 for v in limits)), None) if limits else None


def _shards(job: _Layer, s: ProfileSettings) -> list[ShardProfile]:
    """tp=1 plus one shard per usable requested tp>1; replicated bytes fitted per Korthikanti Table 2."""
    full = _shard(job, 1, s)
    if not is_splittable(job.spec, job.path):
        return [full.model_copy(update={"saved_replicated_bytes_per_sample": _fit_replicated(full, None)})]
    shards: dict[int, ShardProfile] = {}
    wanted = [t for t in s.tp_degrees if t > 1]
    fit_tp = _fit_degree(job.spec, job.path, s.tp_degrees)
    for tp in sorted(set(wanted) | ({fit_tp} if fit_tp else set())):
        try:
            check_tp(job.spec, job.path, tp)
        except StratagemError as exc:  # e.g. an odd vocabulary: this layer stays replicated at that tp
            log.info("no tp=%d shard for %s: %s", tp, job.path, exc)
            continue
        shards[tp] = _shard(job, tp, s)
    replicated = _fit_replicated(full, shards.get(fit_tp) if fit_tp else None)
    return [
        sp.model_copy(update={"saved_replicated_bytes_per_sample": replicated})
        for sp in [full, *(shards[t] for t in wanted if t in shards)]
    ]


def profile_layers(
    spec: ModelSpec, s: ProfileSettings, *, on_layer: Callable[[str], None] | None = None
) -> list[LayerProfile]:
    """Profile every top-level layer of ``spec`` in forward order (see the module docstring)."""
    dtype = torch_dtype(s.dtype)
    x, targets = example_batch(spec, max(s.micro_batches), s.seq_len, device=s.device, dtype=dtype)
    cache: dict[str, tuple[LayerProfile, torch.Tensor]] = {}
    layers: list[LayerProfile] = []
    paths = layer_paths(spec)
    outputs: dict[str, torch.Tensor] = {}  # 3D U-Net: the skip features a decoder layer concatenates
    for i, path in enumerate(paths):
        if spec.family == "unet3d":
            x = layer_input(resolve_dims(spec), path, x, outputs)  # type: ignore[arg-type]
        # hf/custom: the signature is read off the meta template's layer; a copy is built only to profile it
        probe = (
            external(spec).layer(path) if spec.is_external else build_layer(spec, path, device=s.device, dtype=dtype)
        )
        signature = _signature(probe, x)
        if signature in cache:
            profile, out = cache[signature]
            layers.append(profile.model_copy(update={"path": path}))
        else:
            module = build_layer(spec, path, device=s.device, dtype=dtype) if spec.is_external else probe
            job = _Layer(spec=spec, path=path, x_full=x, first=i == 0, targets=targets if i == len(paths) - 1 else None)
            profile, out = (
                _profile_external(job, module, signature, s)
                if spec.is_external
                else _profile_one(job, module, signature, s)
            )
            cache[signature] = (profile, out)
            layers.append(profile)
        x = out
        if spec.family == "unet3d":
            outputs[path] = out
        if on_layer:
            on_layer(path)
    return layers


def _profile_external(
    job: _Layer, module: nn.Module, signature: str, s: ProfileSettings
) -> tuple[LayerProfile, torch.Tensor]:
    """:func:`_profile_one` of an hf:/custom layer; an operation of its code that has no meta kernel or reads a
    tensor's values (DiffLlama's and JetMoE's layers on the meta device) is a one-line error naming the fix."""
    try:
        return _profile_one(job, module, signature, s)
    except (NotImplementedError, RuntimeError) as exc:
        if s.device != "meta":
            raise
        first = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise StratagemError(
            f"{job.spec.source}: layer {job.path} cannot run on the meta device ({type(exc).__name__}: {first}), so "
            f"it cannot be profiled without hardware; measure it with stratagem profile model --model ... --out "
            f"PROFILE.json and plan with --model-profile PROFILE.json"
        ) from None


def _profile_one(
    job: _Layer, module: nn.Module, signature: str, s: ProfileSettings
) -> tuple[LayerProfile, torch.Tensor]:
    log.info("profiling %s (%s)", job.path, signature)
    with torch.no_grad():
        out = module(job.x_full)
    batch = job.x_full.shape[0]
    splittable = is_splittable(job.spec, job.path)
    kind = layer_kind(job.path, job.spec)
    # the last layer's output is the loss: one fp32 scalar per micro-batch (as planner.profile.gpt counts it)
    out_bytes = LOSS_BYTES if job.targets is not None else out.numel() * out.element_size() / batch
    profile = LayerProfile(
        path=job.path,
        kind=kind,
        signature=signature,
        tp_style=_tp_style(job.spec, kind) if splittable else "none",
        input_bytes_per_sample=job.x_full.numel() * job.x_full.element_size() / batch,
        output_bytes_per_sample=out_bytes,
        shards=_shards(job, s),
        collectives=tp_collectives(job.spec, job.path, s.seq_len, dtype=torch_dtype(s.dtype)) if splittable else [],
        runtime_overhead=_overhead(job, splittable, s),
        **expert_fields(module, s.seq_len),
    )
    return profile, out.detach()


def _overhead(job: _Layer, splittable: bool, s: ProfileSettings):
    """Measured wrapper overheads at the smallest micro-batch (``runtime.profiling.overhead``); None when
    nothing is timed (meta device, derived times)."""
    if s.device == "meta" or s.achieved_flops_per_s:
        return None

    def build() -> nn.Module:
        layer = build_layer(job.spec, job.path, device=s.device, dtype=torch_dtype(s.dtype))
        init_weights(layer, seed=0)
        return layer

    return measure_runtime_overhead(
        build,
        job.spec,
        job.path,
        job.x_full[: s.micro_batches[0]],
        first=job.first,
        splittable=splittable,
        warmup=s.warmup,
        repeats=s.repeats,
    )


def _tp_style(spec: ModelSpec, kind: str) -> str:
    if kind == "head" and spec.family in SEQUENCE_FAMILIES:
        return "vocab_parallel"  # LM head + vocab-parallel cross-entropy (Megatron-LM)
    return _TP_STYLES.get(kind, "column")  # a custom model's split layer (its tp_plan)


def effective_seq_len(spec: ModelSpec, seq_len: int) -> int:
    """Tokens per sample: the requested length for language models, 1 otherwise."""
    return seq_len if spec.family in SEQUENCE_FAMILIES else 1


SOURCES = [
    "FLOPs: torch.utils.flop_counter.FlopCounterMode (matmul 2*m*n*k; explicit math attention)",
    "saved bytes: torch.autograd.graph.saved_tensors_hooks, storages deduplicated, parameters excluded",
    "replicated saved bytes: fit saved(t) = R + S/t, Korthikanti et al. 2022 (arXiv:2205.05198) Table 2",
    "TP collectives: Megatron-LM SC21 (arXiv:2104.04473) sec. 2.3; Korthikanti et al. 2022 sec. 4.2.2",
]
NOTES = (
    "Each top-level layer run standalone on a saved copy of its input; layers with equal signatures "
    "profiled once and copied. Replicate-only layers have only the tp=1 shard. A tied LM head's weight "
    "counts in embed only (SC21 eq. 2); with pp > 1 the last stage's copy of it is not in head's params."
)


def profile_model(
    spec: ModelSpec,
    settings: ProfileSettings,
    *,
    created_utc: str,
    command: str | None = None,
    host: str | None = None,
    device_name: str | None = None,
    on_layer: Callable[[str], None] | None = None,
) -> ModelProfile:
    """Profile ``spec`` into a validated :class:`ModelProfile` (not yet written; see ``save_profile``)."""
    check_settings(spec, settings)
    seq_len = effective_seq_len(spec, settings.seq_len)
    s = ProfileSettings(**{**{f: getattr(settings, f) for f in settings.__slots__}, "seq_len": seq_len})
    timed = s.device != "meta" and not s.achieved_flops_per_s
    rates = reference_matmul_rates(s) if timed else []
    with single_rank_group() if timed else contextlib.nullcontext():
        layers = profile_layers(spec, s, on_layer=on_layer)
    rates += reference_matmul_rates(s) if timed else []
    analytic = s.device == "meta"
    return ModelProfile(
        name=f"{spec.name}-s{seq_len}-{s.dtype}",
        model=spec,
        seq_len=seq_len,
        dtype=s.dtype,
        sample_shape=sample_shape(spec, seq_len),
        micro_batches=list(s.micro_batches),
        tp_degrees=list(s.tp_degrees),
        total_params=sum(getattr(layer, "total_params", layer.params) for layer in layers),  # MoE: + routed experts
        layers=layers,
        reference_matmul=reference_matmul_figure(s.dtype, rates),
        provenance=Provenance(
            method="analytic" if analytic else "measured",
            tool=f"stratagem {__version__}",
            created_utc=created_utc,
            torch_version=torch.__version__,
            device_name=device_name or ("meta" if analytic else "cpu"),
            host=host,
            command=command,
            sources=SOURCES
            + (
                [f"times = FLOPs / {s.achieved_flops_per_s:.4g} FLOP/s achieved (cluster profile)"]
                if s.achieved_flops_per_s
                else []
            ),
            notes=NOTES,
        ),
    )


DEFAULT_TP_DEGREES = (1, 2, 4, 8, 16, 32, 64)  # powers of two, as planner.profile.gpt.default_tp_degrees


def default_tp_degrees(spec: ModelSpec) -> tuple[int, ...]:
    """Powers of two up to 64 that the first block's constraints allow (a split classifier skips the degrees that do
    not divide its classes); ``(1,)`` when no layer can be split (e.g. an HF architecture whose layout is not
    derived, a custom model without tp_plan)."""
    paths = layer_paths(spec)
    if not any(is_splittable(spec, p) for p in paths):
        return (1,)
    block = next((p for p in paths if layer_kind(p, spec) == "block"), None)
    limits = list(tp_constraints(spec, block).values()) if block else []
    return tuple(t for t in DEFAULT_TP_DEGREES if all(v % t == 0 for v in limits))


def profile_model_analytic(
    spec: ModelSpec,
    *,
    seq_len: int,
    dtype: str = "bf16",
    micro_batches: tuple[int, ...] = (1,),
    tp_degrees: tuple[int, ...] | None = None,
    achieved_flops_per_s: float | None = None,
    created_utc: str = "",
) -> ModelProfile:
    """FLOPs and memory of any zoo model on the meta device, in seconds, for the planner.

    Without ``achieved_flops_per_s`` the shards carry no timings (the cost model derives them from FLOPs).
    ``tp_degrees`` defaults to the powers of two up to 64 that the model's transformer blocks allow;
    a split classifier skips degrees that do not divide its classes.

    >>> profile_model_analytic(parse_model("resnet:resnet50-wide"), seq_len=1).layer("fc").tp_style
    'column'
    """
    if tp_degrees is None:
        tp_degrees = default_tp_degrees(spec)
    settings = ProfileSettings(
        micro_batches=micro_batches,
        seq_len=seq_len,
        dtype=dtype,
        tp_degrees=tp_degrees,
        device="meta",
        achieved_flops_per_s=achieved_flops_per_s,
    )
    return profile_model(spec, settings, created_utc=created_utc, device_name="meta")
