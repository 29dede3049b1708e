"""Hugging Face causal LMs (``--model hf:PATH``) as zoo-shaped models: ``embed``, ``blocks.i``, ``norm``, ``head``.

The model is built by ``AutoModelForCausalLM.from_config`` on the meta device (no weights allocated, so a 70B
config is profiled on a laptop), with our attention function registered in transformers' ``AttentionInterface``
(:func:`stratagem_attention`): fused SDPA when the plan's ``flash_attention`` says so, else ``QK^T -> softmax ->
@V`` as explicit math like the zoo's (:mod:`runtime.models.attention`). The pieces are then found by structure, not by a per-architecture table:

- the blocks: the longest ``nn.ModuleList`` whose entries share one class (the decoder layers);
- the token embedding and the LM head: ``get_input_embeddings()`` / ``get_output_embeddings()``;
- position embeddings (GPT-2's ``wpe``) and dropouts: embeddings / dropouts outside the blocks that run before
  the first block in a traced forward;
- the final norm: the parameterised module outside the blocks that runs between the last block and the head;
- rotary tables: a module outside the blocks holding a buffer named ``inv_freq`` or ``<layer type>_inv_freq``
  (Gemma 3's local and global tables; its forward then takes the layer's type), else one that runs before the
  first block holding buffers and no weights, when the layers take ``position_embeddings`` (GPT-J's
  ``embed_positions``) (kept unregistered in each block,
  so ``to_empty``/``init_weights`` never touch it).

Each block is wrapped so it takes and returns one tensor, computing its own causal mask and positions; a pipeline
stage is therefore cut by module path exactly like a zoo model (``runtime.executor.stage``).

Mixture-of-Experts configs (Mixtral, Qwen2-MoE, Qwen3-MoE) run transformers' own sparse blocks, every expert on
every rank at ep = etp = 1; a plan with ep or etp > 1 replaces each block's fused experts by the rank's share
(``runtime.executor.hf_moe``: the router, shared expert and gate stay transformers'). They run without the
load-balancing loss, which transformers adds only in the whole model's forward (``output_router_logits``), not per
decoder layer.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from planner.core import StratagemError
from planner.model import ModelSpec
from runtime.models.attention import FUSED_MARK, RECOMPUTE_MARK, attend, causal_bias
from runtime.models.layered import LayeredModel, blocks_dict

if TYPE_CHECKING:
    from transformers.modeling_utils import PreTrainedModel

TRACE_TOKENS = 8  # tokens of the meta forward that orders the modules (any length works)

log = logging.getLogger(__name__)


def require_transformers():
    """The ``transformers`` module, or a one-line error naming the extra to install."""
    try:
        import transformers
    except ImportError:
        raise StratagemError(
            "hf: models need the optional 'transformers' package; install it with pip install 'stratagem[hf]'"
        ) from None
    return transformers


def hf_config(spec: ModelSpec):
    """The ``PretrainedConfig`` of an ``hf`` spec (from the config dict recorded in the spec / plan)."""
    transformers = require_transformers()
    config = dict(spec.config or {})
    model_type = config.pop("model_type", None)
    for key in ("transformers_version", "architectures", "_name_or_path", "torch_dtype", "dtype"):
        config.pop(key, None)
    try:
        return transformers.AutoConfig.for_model(model_type, **config)
    except Exception as exc:  # noqa: BLE001 - any refusal of a foreign config (its validators raise their own types)
        raise StratagemError(
            f"transformers {transformers.__version__} cannot read {spec.source} (model_type "
            f"{model_type!r}: {str(exc).splitlines()[0][:160]}); upgrade transformers or fix the "
            f"config"
        ) from None


def stratagem_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    s_aux: torch.Tensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, None]:
    """The HF attention interface over :func:`runtime.models.attention.attend`: fused SDPA when the block was
    set so (the plan's ``flash_attention``; ``apply_attention`` marks the block's modules), else explicit math in the
    compute dtype like the zoo's.

    HF's "eager" attention takes the softmax in fp32, which on a GPU nobody trains with; the math path saves what
    the zoo's attention saves (one s x s probability tensor in the compute dtype, Korthikanti et al. 2022 §4.1),
    so an HF Llama and the zoo's Llama of the same dimensions profile alike. Query heads per key/value head come
    from the shapes, so it runs unchanged on a TP shard. Inputs (b, heads, s, d); output (b, s, heads, d).
    ``attention_mask``: the block's additive (1, 1, s, s) mask, or None for the plain causal triangle. ``s_aux``:
    GPT-OSS's attention sinks (one logit per head), which ``attend`` adds to each row's softmax.
    """
    visible = None if attention_mask is None else attention_mask[0, 0, :, : key.shape[-2]] == 0
    if s_aux is not None and getattr(module, FUSED_MARK, False) and not _SINKS_WARNED:
        _SINKS_WARNED.append(True)
        log.warning("attention sinks (%s) need the explicit scores: these heads run the math path, not the plan's "
                    "fused attention", type(module).__name__)  # fmt: skip
    out = attend(
        query,
        key,
        value,
        fused=getattr(module, FUSED_MARK, False),
        scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
        dropout_p=dropout,
        training=module.training,
        visible=visible,
        recompute_scores=getattr(module, RECOMPUTE_MARK, False),
        sinks=s_aux,
    )
    return out.transpose(1, 2).contiguous(), None


ATTENTION = "stratagem"
_SINKS_WARNED: list[bool] = []  # the fused-attention warning of attention sinks, once per process


# Config keys whose effect the wrapper does not apply (Gemma 2's attention-score capping inside the attention
# function); the final logit soft-capping is applied (LogitScale)
UNSUPPORTED_KEYS = ("attn_logit_softcapping",)


def _build_causal_lm(spec: ModelSpec) -> PreTrainedModel:
    transformers = require_transformers()
    config = hf_config(spec)
    used = [k for k in UNSUPPORTED_KEYS if getattr(config, k, None)]  # set in the file or by the config's default
    if used:
        raise StratagemError(
            f"{spec.source} sets {', '.join(used)}, which Stratagem's HF wrapper does not apply "
            f"(the model would differ from transformers'); set it to null or plan another model"
        )
    transformers.AttentionInterface.register(ATTENTION, stratagem_attention)
    try:
        with torch.device("meta"):
            model = build_with_attention(transformers, config)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise StratagemError(
            f"{spec.source}: AutoModelForCausalLM cannot build model_type {config.model_type!r} "
            f"({str(exc).splitlines()[0][:160]}); use a causal-LM config"
        ) from None
    if not type(model).is_backend_compatible():
        log.warning(
            "%s: %s computes attention in its own forward, not through transformers' attention interface; "
            "the plan's flash_attention (SDPA or math) does not apply to it, its own attention runs",
            spec.source,
            type(model).__name__,
        )
    return model


def build_with_attention(transformers, config) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_config`` with Stratagem's attention function, or with the model's own eager
    attention where the architecture refuses any function from the interface (Falcon: it computes attention in its
    own forward, as Bloom does after accepting the name); such a model runs its own attention (warned by
    ``_build_causal_lm``), which the fidelity check compares like any other."""
    kwargs = dict(dtype=torch.float32, **experts_kwargs(config))
    try:
        return transformers.AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation=ATTENTION, **kwargs
        )
    except KeyError:  # transformers looked the name up in the model's own table of attention functions
        return transformers.AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation="eager", **kwargs
        )


def experts_kwargs(config) -> dict:
    """MoE configs (Mixtral, Qwen2-MoE, Qwen3-MoE): transformers 5's fused experts default to ``grouped_mm``,
    whose CPU and meta kernels take bf16 only, and ``eager`` selects tokens with ``nonzero`` (no meta shape);
    ``batched_mm`` gathers each token's expert weights and runs one ``bmm`` per projection, which works on CPU
    and meta with the top-k FLOPs (its saved tensors include the gathered weights, so activation memory
    measured on meta overstates a grouped-GEMM kernel's). The runtime trains with the per-expert loop instead
    (:func:`use_loop_experts`)."""
    return {"experts_implementation": "batched_mm"} if hasattr(config, "_experts_implementation") else {}


def use_loop_experts(model: nn.Module) -> int:
    """Run every transformers fused-experts module of ``model`` with transformers' ``eager`` implementation (a loop
    over the experts that have tokens) instead of ``batched_mm``, which the model is built with for the meta
    device (:func:`experts_kwargs`): ``batched_mm`` gathers each (token, choice)'s expert weights, ``2 I x H`` and
    ``H x I`` per row, and saves them for the backward (measured on a tiny Mixtral, 4 experts: a step held 120 MiB
    of live tensors against 8 MiB under the loop, ``benchmarks/memory_accuracy.py``). The choice is read from the
    module's config at each forward (transformers' ``use_experts_implementation``); returns how many configs
    changed. Call it on a model materialised on a real device."""
    changed = 0
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "_experts_implementation", None) == "batched_mm":
            config._experts_implementation = "eager"
            changed += 1
    return changed


class HFEmbedding(nn.Module):
    """Token embedding (``tok``), plus learned positions (``pos``) and dropout when the model has them;
    ``multiplier``: the factor the model's own forward applies to the token embeddings (Granite's
    ``embedding_multiplier``)."""

    def __init__(
        self,
        tok: nn.Module,
        pos: nn.Module | None,
        drop: nn.Module | None,
        multiplier: float = 1.0,
        norm: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.tok, self.pos, self.drop, self.multiplier = tok, pos, drop, multiplier
        if norm is not None:  # a norm the model applies to the embeddings before the first layer (Bloom)
            self.norm = norm
        self._pos_takes_ids = pos is not None and "position_ids" in inspect.signature(pos.forward).parameters

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        if self.multiplier != 1.0:
            x = x * self.multiplier
        if self.pos is not None:
            positions = torch.arange(ids.shape[1], device=ids.device)
            if self._pos_takes_ids:  # OPT's learned positions: forward(attention_mask, ..., position_ids), offset 2
                x = x + self.pos(torch.ones_like(ids), position_ids=positions[None].expand_as(ids))
            else:
                x = x + self.pos(positions)
        if hasattr(self, "norm"):
            x = self.norm(x)
        return self.drop(x) if self.drop is not None else x


class HFBlock(nn.Module):
    """One decoder layer taking and returning the hidden states (b, s, h); causal mask and positions made here.

    The additive (1, 1, s, s) mask is what ``create_causal_mask`` (``create_sliding_window_causal_mask`` for a
    sliding-window layer, transformers ``masking_utils``) gives the eager attention without padding.
    """

    _alibi: Callable | None  # both set with object.__setattr__, so not registered as submodules
    _rotary: nn.Module | None

    def __init__(
        self,
        layer: nn.Module,
        rotary: nn.Module | None,
        window: int | None = None,
        layer_type: str | None = None,
        *,
        own_attention: bool = False,
        alibi: Callable | None = None,
    ) -> None:
        super().__init__()
        self.layer, self.window = layer, window
        # a layer computing attention in its own forward gets the causal mask as a tensor (it adds what it is given)
        self.own_attention = own_attention
        object.__setattr__(self, "_alibi", alibi)  # ALiBi biases the model's forward builds for each layer (Bloom)
        object.__setattr__(self, "_rotary", rotary)  # unregistered: fixed tables, never sharded or re-initialised
        # a rotary module holding one table per layer type (Gemma 3) is asked for this layer's
        takes_type = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
        self._rotary_kwargs = {"layer_type": layer_type} if takes_type else {}
        self.fused_attention = False  # SDPA (the plan's flash_attention) or math (apply_attention)
        self.recompute_scores = False  # selective recompute of the math core (apply_ac marks the submodules)
        params = inspect.signature(layer.forward).parameters
        self._kwargs = {k for k in ("attention_mask", "position_ids", "position_embeddings", "alibi") if k in params}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        positions = torch.arange(s, device=x.device).unsqueeze(0)
        mask = None  # the plain causal triangle: stratagem_attention's is_causal
        if self.window is not None:  # sliding window: key j visible from query i when i - window < j <= i
            mask = causal_bias(s, device=x.device, dtype=x.dtype)
            mask = (mask + torch.full((s, s), float("-inf"), device=x.device, dtype=x.dtype).tril(-self.window))[
                None, None
            ]
        if self.own_attention:  # the (batch, 1, s, s) mask transformers' mask functions give it
            mask = (causal_bias(s, device=x.device, dtype=x.dtype)[None, None] if mask is None else mask).expand(
                x.shape[0], 1, s, s
            )
        kwargs: dict[str, object] = {"attention_mask": mask, "position_ids": positions}
        if "alibi" in self._kwargs:
            kwargs["alibi"] = self._alibi(x.shape[0], s, x.device, x.dtype) if self._alibi is not None else None
        if self._rotary is not None:
            tables = self._rotary(x, positions, **self._rotary_kwargs)  # a table lookup stays on the table's device
            kwargs["position_embeddings"] = tuple(t.to(x.device) for t in tables)
        out = self.layer(x, **{k: v for k, v in kwargs.items() if k in self._kwargs})
        return out[0] if isinstance(out, tuple) else out


@dataclass(frozen=True, kw_only=True, slots=True)
class HFParts:
    """Module paths (inside the HF model) of each piece, found by structure."""

    tok: str
    pos: str | None
    emb_norm: str | None
    drop: str | None
    blocks: str
    norm: str | None
    head: str
    rotary: str | None
    tied: bool


def _block_list(model: nn.Module) -> str:
    best, best_len = None, 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > best_len:
            if len({type(m) for m in module}) == 1:
                best, best_len = name, len(module)
    if best is None:
        raise StratagemError(
            f"{type(model).__name__} has no list of identical decoder layers (nn.ModuleList); "
            f"it cannot be cut into pipeline stages"
        )
    return best


def _call_order(model: nn.Module, vocab: int) -> list[str]:
    """Module paths in the order their forward starts, from one forward on the model's device (meta when it is
    built for planning, CPU for the fidelity check)."""
    device = next(model.parameters()).device
    order: list[str] = []
    handles = [
        m.register_forward_pre_hook(lambda _m, _a, name=name: order.append(name))
        for name, m in model.named_modules()
        if name
    ]
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros(1, TRACE_TOKENS, dtype=torch.long, device=device) % vocab)
    finally:
        for h in handles:
            h.remove()
    return order


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent + ".")


def _is_norm(module: nn.Module) -> bool:
    """A final norm: a module with its own parameters, or a norm without any (OLMo's LayerNorm has no weight)."""
    own = any(True for _ in module.parameters(recurse=False))
    return own or isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or "norm" in type(module).__name__.lower()


def find_parts(model: PreTrainedModel, spec: ModelSpec) -> HFParts:
    """Locate the pieces of ``model`` (built on meta) by structure; see the module docstring."""
    names = {id(m): n for n, m in model.named_modules()}
    tok, head = names.get(id(model.get_input_embeddings())), names.get(id(model.get_output_embeddings()))
    if tok is None or head is None:
        raise StratagemError(f"{spec.source}: the model has no input embedding or no LM head; use a causal-LM config")
    blocks = _block_list(model)
    try:
        order = _call_order(model, int(spec.dims.get("vocab", 2)))
    except (NotImplementedError, RuntimeError) as exc:  # an operation that reads tensor values (JetMoE's router)
        reason = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise StratagemError(
            f"{spec.source}: {type(model).__name__} cannot run on the meta device ({type(exc).__name__}: {reason}), "
            f"where Stratagem traces a model to find its parts; this architecture is not supported, plan another model"
        ) from None
    inner = [p for p in order if _inside(p, blocks)]
    first = order.index(inner[0])
    last_block_call = max(i for i, p in enumerate(order) if _inside(p, blocks))
    head_call = order.index(head)
    outside = lambda p: not _inside(p, blocks) and not _inside(p, head) and not _inside(p, tok)  # noqa: E731
    modules = dict(model.named_modules())
    before = [p for p in order[:first] if outside(p)]
    pos = [p for p in before if isinstance(modules[p], nn.Embedding)]
    drop = [p for p in before if isinstance(modules[p], nn.Dropout)]
    rotary = [
        p
        for p, m in modules.items()
        if outside(p) and any(n.endswith("inv_freq") for n, _ in m.named_buffers(recurse=False))
    ]
    layer_takes = inspect.signature(cast(nn.ModuleList, modules[blocks])[0].forward).parameters
    if not rotary and "position_embeddings" in layer_takes:
        # tables under another name (GPT-J's embed_positions): buffers, no weights, run before the blocks
        rotary = [
            p
            for p in before
            if any(True for _ in modules[p].buffers(recurse=False)) and not any(True for _ in modules[p].parameters())
        ]
    norms = [p for p in order[last_block_call + 1 : head_call] if outside(p) and _is_norm(modules[p])]
    if len(pos) > 1 or len(norms) > 1:
        raise StratagemError(
            f"{spec.source}: found {len(pos)} position embeddings and {len(norms)} final norms "
            f"({', '.join(pos + norms)}); only one of each is supported"
        )
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    emb_norms = [
        p
        for p in before
        if isinstance(modules[p], (nn.LayerNorm, nn.RMSNorm)) or "norm" in type(modules[p]).__name__.lower()
    ]
    if len(emb_norms) > 1:
        raise StratagemError(
            f"{spec.source}: found {len(emb_norms)} norms before the first layer; only one is supported"
        )
    return HFParts(
        tok=tok,
        emb_norm=emb_norms[0] if emb_norms else None,
        pos=pos[0] if pos else None,
        drop=drop[0] if drop else None,
        blocks=blocks,
        norm=norms[0] if norms else None,
        head=head,
        rotary=rotary[0] if rotary else None,
        tied=tied,
    )


def _rotary_on_cpu(model: PreTrainedModel, parts: HFParts) -> nn.Module | None:
    """A CPU copy of the rotary-table module (its buffers computed from the config, not left on meta)."""
    if parts.rotary is None:
        return None
    meta = model.get_submodule(parts.rotary)
    with torch.device("cpu"):
        return type(meta)(config=model.config)


def sliding_window(config, index: int) -> int | None:
    """Window of layer ``index``: per ``layer_types`` when the config lists them (Qwen2, Gemma-style), else the
    config's ``sliding_window`` for every layer (Mistral); None = full causal attention."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window:
        return None
    if types:
        return window if types[index] == "sliding_attention" else None
    return window


def _alibi(build: Callable, heads: int, batch: int, seq: int, device: torch.device, dtype: torch.dtype):
    return build(torch.ones(batch, seq, dtype=torch.long, device=device), heads, dtype)


def alibi_builder(model: PreTrainedModel) -> Callable | None:
    """The ALiBi biases (Press et al. 2022) the model's forward builds for its layers, as ``(batch, seq, device,
    dtype) -> tensor``: the model module's own ``build_alibi_tensor`` on an all-ones mask (no padding), which is what
    transformers computes then. None when the config switches ALiBi off (Falcon's ``alibi: false``) or the layers do
    not take it."""
    layers = cast(nn.ModuleList, model.get_submodule(_block_list(model)))
    if "alibi" not in inspect.signature(layers[0].forward).parameters or getattr(model.config, "alibi", True) is False:
        return None
    build = getattr(sys.modules[type(model).__module__], "build_alibi_tensor", None)
    if build is None:
        raise StratagemError(
            f"{type(model).__name__}'s layers take ALiBi biases but its module has no build_alibi_tensor; "
            f"this architecture is not supported, plan another model"
        )
    return functools.partial(_alibi, build, int(model.config.num_attention_heads))


def _layer_type(config, index: int) -> str | None:
    types = getattr(config, "layer_types", None)
    return types[index] if types and index < len(types) else None


class HFInit:
    """transformers' own ``_init_weights`` for the modules whose values are constants, not random draws: buffers
    (Gemma's ``embed_scale``) and norms (Gemma's RMSNorm weight is 0 for ``1 + weight``). ``init_weights`` calls
    it first and leaves the tensors it returns alone; random weights keep the seeded, per-path init."""

    def __init__(self, hf_model: PreTrainedModel) -> None:
        self.init_module = hf_model._init_weights  # bound to the meta model; runs on any materialized module

    def __deepcopy__(self, memo: dict) -> "HFInit":
        return self  # shared by every copy of the template (it holds no tensors of theirs)

    @torch.no_grad()
    def __call__(self, model: nn.Module) -> set[str]:
        done: set[str] = set()
        for path, module in model.named_modules():
            if not type(module).__module__.startswith("transformers."):
                continue
            buffers = [n for n, b in module.named_buffers(recurse=False) if b is not None and b.device.type != "meta"]
            norm = "norm" in type(module).__name__.lower()
            params = [n for n, p in module.named_parameters(recurse=False) if p.device.type != "meta"] if norm else []
            if buffers or params:
                self.init_module(module)
                done |= {f"{path}.{n}" if path else n for n in buffers + params}
        return done


@dataclass(frozen=True, slots=True)
class LogitScale:
    """What the model's own forward does to the LM head's output (a forward hook on the head): multiply by
    ``multiplier`` (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``), then soft-cap at ``cap``
    (Gemma 2/3's ``final_logit_softcapping``: ``cap * tanh(logits / cap)``)."""

    multiplier: float = 1.0
    cap: float | None = None

    def __call__(self, _module: nn.Module, _inputs: tuple, out: torch.Tensor) -> torch.Tensor:
        if self.multiplier != 1.0:
            out = out * self.multiplier
        if self.cap:
            out = torch.tanh(out / self.cap) * self.cap
        return out


def outside_scales(config) -> tuple[float, LogitScale]:
    """(embedding multiplier, logit scale) that the HF model's forward applies outside the modules the wrapper
    calls, read from the config keys that carry them."""
    embedding = float(getattr(config, "embedding_multiplier", None) or 1.0)
    logits = float(getattr(config, "logit_scale", None) or 1.0)
    if getattr(config, "logits_scaling", None):
        logits /= float(config.logits_scaling)
    cap = getattr(config, "final_logit_softcapping", None)
    return embedding, LogitScale(multiplier=logits, cap=float(cap) if cap else None)


@functools.lru_cache(maxsize=8)
def _template(spec_json: str) -> tuple[LayeredModel, HFParts]:
    spec = ModelSpec.model_validate_json(spec_json)
    return wrap_causal_lm(_build_causal_lm(spec), spec)


def wrap_causal_lm(model: PreTrainedModel, spec: ModelSpec) -> tuple[LayeredModel, HFParts]:
    """The :class:`LayeredModel` over ``model``'s own modules (built on meta for planning, on CPU with weights for
    the fidelity check, :mod:`runtime.models.fidelity`) and the parts found."""
    parts = find_parts(model, spec)
    rotary = _rotary_on_cpu(model, parts)
    get = model.get_submodule
    multiplier, logit_scale = outside_scales(model.config)
    alibi = alibi_builder(model)
    emb_norm = get(parts.emb_norm) if parts.emb_norm else None
    if emb_norm is not None and parts.emb_norm == parts.norm:
        # one norm module applied before the layers and after them (NanoChat's model.norm): each place gets its
        # own module, or a layout set on the final norm (sequence parallel's sharding hooks, a pipeline stage)
        # would also act on the embeddings
        if any(True for _ in emb_norm.parameters()):
            raise StratagemError(
                f"{spec.source}: the norm {parts.emb_norm} has weights and is applied both before the first layer "
                f"and after the last; a norm shared by two places is supported only without weights, plan another model"
            )
        emb_norm = copy.deepcopy(emb_norm)
    layers = {
        "embed": HFEmbedding(
            get(parts.tok),
            get(parts.pos) if parts.pos else None,
            get(parts.drop) if parts.drop else None,
            multiplier,
            emb_norm,
        ),
        "blocks": blocks_dict(
            [
                HFBlock(
                    layer,
                    rotary,
                    sliding_window(model.config, i),
                    _layer_type(model.config, i),
                    own_attention=not type(model).is_backend_compatible(),
                    alibi=alibi,
                )
                for i, layer in enumerate(cast(nn.ModuleList, get(parts.blocks)))
            ]
        ),
    }
    if parts.norm:
        layers["norm"] = get(parts.norm)
    layers["head"] = get(parts.head)
    if logit_scale != LogitScale():
        layers["head"].register_forward_hook(logit_scale)
    wrapped = LayeredModel(layers, tie_embeddings=parts.tied)
    object.__setattr__(wrapped, "external_init", HFInit(model))
    return wrapped, parts


def build_hf(spec: ModelSpec) -> LayeredModel:
    """A fresh meta-device :class:`LayeredModel` of the HF model (``embed``, ``blocks.i``, ``norm``, ``head``)."""
    template, _ = _template(spec_key(spec))
    model = copy.deepcopy(template)
    if model.tie_embeddings:
        model.get_submodule("head").weight = model.get_parameter("embed.tok.weight")
    return model


def hf_parts(spec: ModelSpec) -> HFParts:
    return _template(spec_key(spec))[1]


def hf_conversion_mapping(spec: ModelSpec) -> list:
    """transformers' renames and fusions between how it saves this model type and how it trains it (Mixtral: its
    per-expert ``w1``/``w2``/``w3`` tensors fused into ``experts.gate_up_proj``); [] when both are the same."""
    require_transformers()
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    return list(get_checkpoint_conversion_mapping((spec.config or {}).get("model_type", "")) or [])


def spec_key(spec: ModelSpec) -> str:
    """A canonical JSON text of the spec (the cache key of the meta-built templates)."""
    return json.dumps(spec.model_dump(mode="json"), sort_keys=True)
