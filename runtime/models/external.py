"""Models from outside the zoo (``hf:`` configs, your own ``nn.Module``) behind the zoo's functions.

:func:`external` returns, once per spec, an :class:`ExternalModel`: the meta-device template, its layer paths
and kinds, and each layer's tensor-parallel layout as plain data (submodule path -> style, the zoo's styles).

Layouts. A custom model states its own (``tp_plan``). For an HF model the layout of a block is *derived* from
its module tree: its ``nn.Linear`` modules are grouped by parent (the attention, the MLP) in the order a meta
forward calls them; in each group the last one called maps back to the hidden size and is ``rowwise``, the
earlier ones read the hidden size and are ``colwise`` (Megatron-LM, Shoeybi et al. 2019 §3). A colwise
projection in the attention must produce whole heads (``heads * head_dim`` or ``kv_heads * head_dim``
features), so a fused q/k/v projection (GPT-2's ``c_attn``, NeoX's ``query_key_value``), whose head order cannot
be seen in the structure, is not split. The derived layout is then *run*: a tp=2 shard of the block (its colwise
outputs and rowwise inputs halved) must run a meta forward, which proves the attention reshapes by the local
head count. When any check fails, no layer is split, TP is not searched, and :attr:`ExternalModel.tp_note`
says why (it goes into the plan). Embedding and LM head are vocab-parallel when the blocks are split.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from planner.core import StratagemError
from planner.model import ModelSpec
from planner.profile import CollectiveNeed
from runtime.models.custom import INPUT_DTYPES, STYLES, InputSpec, custom_template
from runtime.models.gpt import VocabShardEmbedding
from runtime.models.layered import LayeredModel

FP32_BYTES = 4  # the parallel cross-entropy exchanges fp32 per-token max / sum-exp / target logit


@dataclass(frozen=True, kw_only=True)
class ExternalModel:
    """A non-zoo model as the zoo's functions need it (see the module docstring)."""

    spec: ModelSpec
    template: LayeredModel
    paths: list[str]
    kinds: dict[str, str]
    layouts: dict[str, dict[str, str]] = field(default_factory=dict)  # path -> {relative path: style}
    constraints: dict[str, dict[str, int]] = field(default_factory=dict)
    inputs: InputSpec
    target_shape: tuple[int, ...] = ()  # per sample, custom models (class ids of the output minus its last dim)
    tp_note: str = ""  # why tensor parallelism is not searched ("" = it is)

    def layer(self, path: str) -> nn.Module:
        return self.template.get_submodule(path)


def _paths(model: LayeredModel) -> list[str]:
    return model.layer_paths()


def _kinds(model: LayeredModel, spec: ModelSpec) -> dict[str, str]:
    paths = _paths(model)
    if spec.family == "hf":
        return {
            p: {"embed": "embedding", "blocks": "block", "norm": "norm", "head": "head"}[p.split(".")[0]] for p in paths
        }
    return {p: "block" if "." in p else "layer" for p in paths}


# ---- HF: derive the block layout from the module tree ------------------------------------------------------


def _linear_groups(block: nn.Module, hidden: int) -> list[list[tuple[str, nn.Linear]]]:
    """The block's Linears grouped by parent module, each group in call order (from a meta forward)."""
    order: list[str] = []
    linears = {n: m for n, m in block.named_modules() if isinstance(m, nn.Linear)}
    handles = [m.register_forward_pre_hook(lambda _m, _a, n=n: order.append(n)) for n, m in linears.items()]
    try:
        with torch.no_grad():
            block(torch.zeros(1, 4, hidden, device="meta"))
    finally:
        for h in handles:
            h.remove()
    groups: dict[str, list[tuple[str, nn.Linear]]] = {}
    for name in dict.fromkeys(order):
        groups.setdefault(name.rpartition(".")[0], []).append((name, linears[name]))
    return list(groups.values())


def _hf_block_layout(block: nn.Module, spec: ModelSpec) -> tuple[dict[str, str], dict[str, int], str]:
    """(layout, the sizes tp must divide, "" or why no layout) of one wrapped HF decoder block (``HFBlock``)."""
    cfg = spec.config or {}
    hidden, heads = int(spec.dims.get("hidden", 0)), int(spec.dims.get("heads", 0))
    kv = int(spec.dims.get("kv_heads", 0) or heads)
    head_dim = int(cfg.get("head_dim") or (hidden // heads if heads else 0))
    layer = block.get_submodule("layer")
    params = [
        n
        for n, m in layer.named_modules()
        if any(True for _ in m.parameters(recurse=False))
        and not isinstance(m, nn.Linear)
        and "norm" not in type(m).__name__.lower()
    ]
    if params:
        return (
            {},
            {},
            (
                f"the block holds parameters outside nn.Linear ({', '.join(params[:3])}: "
                f"{type(layer.get_submodule(params[0])).__name__}), so no Megatron layout is derived"
            ),
        )
    layout: dict[str, str] = {}
    limits = {"heads": heads, "kv_heads": kv}
    for group in _linear_groups(block, hidden):
        *cols, (row_name, row) = group
        if not cols or row.out_features != hidden or any(m.in_features != hidden for _, m in cols):
            names = ", ".join(n for n, _ in group)
            return {}, {}, f"the Linears [{names}] are not a column-parallel -> row-parallel pair over hidden {hidden}"
        head_outs = {heads * head_dim, kv * head_dim}
        attention = row.in_features == heads * head_dim and any(m.out_features in head_outs for _, m in cols)
        for name, m in cols:
            if attention and m.out_features not in head_outs:
                return (
                    {},
                    {},
                    (
                        f"{name} produces {m.out_features} features, not whole heads ({heads} or {kv} x "
                        f"{head_dim}): a fused q/k/v projection whose head order is not known"
                    ),
                )
            layout[name] = "colwise"
            if not attention:
                limits[f"{name}.out_features"] = m.out_features
        layout[row_name] = "rowwise"
    if "rowwise" not in layout.values():
        return {}, {}, "the block has no nn.Linear to split"
    return layout, limits, ""


def _hf_layouts(model: LayeredModel, spec: ModelSpec) -> tuple[dict, dict, str]:
    """One layout for every block, derived from each block: blocks differ in MoE configs whose leading blocks are
    dense (Qwen2-MoE ``mlp_only_layers``, DeepSeek ``first_k_dense_replace``), and one that cannot be split
    keeps the whole model at tp 1 (a plan has one tp per stage)."""
    paths = [p for p in model.layer_paths() if p.startswith("blocks.")]
    block = model.get_submodule(paths[0])
    layout, limits, note = _hf_block_layout(block, spec)
    for path in paths[1:]:
        if note:
            break
        other, _, other_note = _hf_block_layout(model.get_submodule(path), spec)
        if other_note or other != layout:
            note = f"{path}: {other_note}" if other_note else f"{path} is laid out unlike {paths[0]}"
    if note:
        return {}, {}, f"tensor parallelism not searched: {note}"
    try:
        shard = shard_module(block, layout, 2)
        with torch.no_grad():
            shard(torch.zeros(1, 4, int(spec.dims["hidden"]), device="meta"))
    except Exception as exc:  # the architecture's own code: any failure means the layout does not hold
        return (
            {},
            {},
            (
                f"tensor parallelism not searched: a block with half its heads does not run "
                f"({type(exc).__name__}: {str(exc)[:120]})"
            ),
        )
    vocab = int(spec.dims.get("vocab", 0))
    layouts = {p: dict(layout) for p in paths}
    constraints = {p: dict(limits) for p in layouts}
    layouts["embed"], constraints["embed"] = {"tok": "vocab_embedding"}, {"vocab": vocab}
    layouts["head"], constraints["head"] = {"": "colwise_sharded_output"}, {"vocab": vocab}
    return layouts, constraints, ""


# ---- custom: the user's tp_plan ------------------------------------------------------------------------------


def _custom_layouts(model: LayeredModel, tp_plan: dict, source: str) -> tuple[dict, dict, str]:
    if not tp_plan:
        return {}, {}, "tensor parallelism not searched: the model has no tp_plan"
    layouts, constraints = {}, {}
    for path in model.layer_paths():
        layer = model.get_submodule(path)
        plan = tp_plan.get(type(layer).__name__)
        if plan is None:
            continue
        layout, limits = {}, {}
        for rel, style in plan.items():
            try:
                sub = layer.get_submodule(rel) if rel else layer
            except AttributeError:
                raise StratagemError(
                    f"{source}: tp_plan entry {rel!r} of {type(layer).__name__} is not a submodule "
                    f"of layer {path}; use paths inside the layer, e.g. 'fc1'"
                ) from None
            if style not in STYLES:
                raise StratagemError(
                    f"{source}: tp_plan style {style!r} for {rel!r} is unknown; use one of {', '.join(STYLES)}"
                )
            want = nn.Embedding if style == "vocab_embedding" else nn.Linear
            if not isinstance(sub, want):
                raise StratagemError(
                    f"{source}: tp_plan gives {rel or path!r} style {style} but it is a "
                    f"{type(sub).__name__}, not an nn.{want.__name__}"
                )
            split = (
                sub.num_embeddings
                if isinstance(sub, nn.Embedding)
                else (sub.in_features if style == "rowwise" else sub.out_features)
            )
            layout[rel], limits[f"{rel or path}.split_features"] = style, split
        limits.update(getattr(model, "tp_divides", {}))
        layouts[path], constraints[path] = layout, limits
    return layouts, constraints, ""


def _meta_runs_up_to(model: LayeredModel, layouts: dict, x: torch.Tensor) -> dict[str, int]:
    """Per split layer, the largest power of two up to 64 such that its shard at every power of two up to it runs
    forward on meta (1: not even tp=2). A model that reshapes a shard's features into a fixed head count fails at
    the first degree its heads do not take; that degree and the larger ones are then never profiled or planned."""
    inputs: dict[str, torch.Size] = {}
    handles = [
        model.get_submodule(path).register_forward_pre_hook(
            lambda _m, args, path=path: inputs.__setitem__(path, args[0].shape)
        )
        for path in layouts
    ]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    out = {}
    for path, shape in inputs.items():
        ok = 1
        for tp in (2, 4, 8, 16, 32, 64):
            try:
                with torch.no_grad():
                    shard_module(model.get_submodule(path), layouts[path], tp)(torch.empty(shape, device="meta"))
            except Exception:  # any failure of the user's forward at this degree bounds it
                break
            ok = tp
        out[path] = ok
    return out


# ---- the one entry point -------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _external(spec_json: str) -> ExternalModel:
    spec = ModelSpec.model_validate_json(spec_json)
    if spec.family == "hf":
        from runtime.models.hf import build_hf

        model = build_hf(spec)
        layouts, constraints, note = _hf_layouts(model, spec)
        inputs = InputSpec(
            sample_shape=(),
            dtype="int64",
            vocab=int(spec.dims.get("vocab", 0)),
            num_classes=int(spec.dims.get("vocab", 0)),
        )
    else:
        model, inputs, tp_plan = custom_template(spec)
        layouts, constraints, note = _custom_layouts(model, tp_plan, spec.source or "custom model")
        x = torch.zeros((1, *inputs.sample_shape), dtype=INPUT_DTYPES[inputs.dtype], device="meta")
        for path, runs in _meta_runs_up_to(model, layouts, x).items():
            constraints[path]["meta_forward_runs_up_to_tp"] = runs
        with torch.no_grad():
            out = model(x)
        if out.shape[-1] != inputs.num_classes:
            raise StratagemError(
                f"{spec.source}: the output's last dimension is {out.shape[-1]} but input_spec "
                f"says num_classes={inputs.num_classes}; make them equal"
            )
        return ExternalModel(
            spec=spec,
            template=model,
            paths=model.layer_paths(),
            kinds=_kinds(model, spec),
            layouts=layouts,
            constraints=constraints,
            inputs=inputs,
            tp_note=note,
            target_shape=tuple(out.shape[1:-1]),
        )
    return ExternalModel(
        spec=spec,
        template=model,
        paths=model.layer_paths(),
        kinds=_kinds(model, spec),
        layouts=layouts,
        constraints=constraints,
        inputs=inputs,
        tp_note=note,
    )


_KEYS: dict[int, tuple[ModelSpec, str]] = {}  # id(spec) -> (spec, its JSON key): dumping a 70B config costs ~1 ms


def external(spec: ModelSpec) -> ExternalModel:
    """The (cached) :class:`ExternalModel` of an ``hf`` or ``custom`` spec."""
    known = _KEYS.get(id(spec))
    if known is None or known[0] is not spec:
        if len(_KEYS) > 64:
            _KEYS.clear()
        known = _KEYS[id(spec)] = (spec, json.dumps(spec.model_dump(mode="json"), sort_keys=True))
    return _external(known[1])


def build_external(spec: ModelSpec) -> LayeredModel:
    """A fresh meta-device copy of the whole model."""
    ext = external(spec)
    if spec.family == "hf":
        from runtime.models.hf import build_hf

        return build_hf(spec)
    return copy.deepcopy(ext.template)


HEAD_COUNT_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_heads")


def localise_head_counts(module: nn.Module, tp: int) -> None:
    """Divide the head counts that attention modules keep as attributes by ``tp``. transformers' OPT reshapes its
    projections with ``view(b, -1, self.num_heads, head_dim)``: with half the features and the whole head count the
    ``-1`` takes half the sequence, which runs and computes something else (measured: OPT's TP2 step-1 loss 3.2e-3
    off transformers', while DP2 and PP2 matched it within 1e-6). Counts taken from the config are untouched."""
    if tp == 1:
        return
    for sub in module.modules():
        for name in HEAD_COUNT_ATTRS:
            value = sub.__dict__.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value % tp == 0:
                setattr(sub, name, value // tp)


def shard_module(module: nn.Module, layout: dict[str, str], tp: int) -> nn.Module:
    """A meta copy of ``module`` computing what one of ``tp`` ranks computes under ``layout``."""
    shard = copy.deepcopy(module)
    if any(style in ("colwise", "rowwise") for style in layout.values()):
        localise_head_counts(shard, tp)
    with torch.device("meta"):
        for rel, style in layout.items():
            sub = shard.get_submodule(rel) if rel else shard
            # _hf_layouts and _custom_layouts gave vocab_embedding to nn.Embedding, the other styles to nn.Linear
            if style == "vocab_embedding":
                emb = cast(nn.Embedding, sub)
                new: nn.Module = VocabShardEmbedding(emb.num_embeddings // tp, emb.embedding_dim)
            elif style == "rowwise":
                lin = cast(nn.Linear, sub)
                new = nn.Linear(lin.in_features // tp, lin.out_features, bias=lin.bias is not None)
            else:  # colwise, colwise_sharded_output
                lin = cast(nn.Linear, sub)
                new = nn.Linear(lin.in_features, lin.out_features // tp, bias=lin.bias is not None)
            if not rel:
                return new
            parent, _, name = rel.rpartition(".")
            setattr(shard.get_submodule(parent) if parent else shard, name, new)
    return shard


def build_external_layer(spec: ModelSpec, path: str, tp: int) -> nn.Module:
    """One layer on meta; ``tp`` > 1 gives one rank's shard (see :func:`shard_module`)."""
    ext = external(spec)
    layer = ext.layer(path)
    return shard_module(layer, ext.layouts.get(path, {}), tp) if tp > 1 else copy.deepcopy(layer)


def external_collectives(spec: ModelSpec, path: str, x: torch.Tensor, elem_bytes: int) -> list[CollectiveNeed]:
    """TP collectives of a split layer per sample, from a meta forward on ``x`` (one sample):

    rowwise: forward all-reduce of its output ("g"); each group of colwise Linears: backward all-reduce of their
    shared input ("f") — Megatron-LM (Shoeybi et al. 2019 §3); vocab embedding: forward all-reduce of its
    output; split head: backward all-reduce of its input plus the parallel cross-entropy's 3 fp32 all-reduces
    per token (Megatron ``vocab_parallel_cross_entropy``).
    """
    ext = external(spec)
    layout = ext.layouts.get(path, {})
    layer = ext.layer(path)
    sizes: dict[str, tuple[int, int]] = {}
    handles = [
        (layer.get_submodule(rel) if rel else layer).register_forward_hook(
            lambda _m, a, out, rel=rel: sizes.__setitem__(rel, (a[0].numel(), out.numel()))
        )
        for rel in layout
    ]
    try:
        with torch.no_grad():
            layer(x.to("meta"))
    finally:
        for h in handles:
            h.remove()
    needs, parents = [], set()
    for rel, style in layout.items():
        n_in, n_out = sizes.get(rel, (0, 0))
        if style in ("rowwise", "vocab_embedding"):
            needs.append(CollectiveNeed(op="all_reduce", phase="forward", bytes_per_sample=n_out * elem_bytes))
        elif style == "colwise" and rel.rpartition(".")[0] not in parents:
            parents.add(rel.rpartition(".")[0])
            needs.append(CollectiveNeed(op="all_reduce", phase="backward", bytes_per_sample=n_in * elem_bytes))
        elif style == "colwise_sharded_output":
            sub = layer.get_submodule(rel) if rel else layer
            tokens = n_out // cast(nn.Linear, sub).out_features
            needs += [
                CollectiveNeed(op="all_reduce", phase="backward", bytes_per_sample=n_in * elem_bytes),
                CollectiveNeed(op="all_reduce", phase="forward", bytes_per_sample=tokens * FP32_BYTES, count=3),
            ]
    return needs


def external_example_input(spec: ModelSpec, micro_batch: int, seq_len: int) -> list[int]:
    """Input shape of a batch: ``(b, seq)`` token ids for hf, ``(b, *sample_shape)`` for custom models."""
    ext = external(spec)
    return [micro_batch, seq_len] if spec.family == "hf" else [micro_batch, *ext.inputs.sample_shape]


def input_dtype(spec: ModelSpec) -> torch.dtype:
    return INPUT_DTYPES[external(spec).inputs.dtype]
