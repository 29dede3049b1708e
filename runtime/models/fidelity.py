"""The fidelity check of an ``hf:`` model: the wrapper the runtime trains computes transformers' logits.

Before an ``hf:`` config is profiled or planned, a tiny instance of it — the config's own structure (its
architecture, layer types, attention options, scalings), sizes shrunk (:func:`tiny_config`) — is built twice on
CPU in fp32: transformers' own ``AutoModelForCausalLM`` with its eager attention, and the same model with
Stratagem's attention wrapped as the runtime trains it (:func:`runtime.models.hf.wrap_causal_lm`), with the first
one's weights. Both run one batch of token ids; a largest absolute logit difference above
:data:`FIDELITY_TOLERANCE` refuses the model in one line naming the first part whose output differs (the
embedding, a decoder layer, or what follows the last one). The figure goes into the plan
(:class:`planner.model.spec.Fidelity`).
"""

from __future__ import annotations

import copy
import math
import time
from typing import cast

import torch
from torch import nn

from planner.core import StratagemError
from planner.model import Fidelity, ModelSpec
from runtime.models.hf import (
    ATTENTION,
    build_with_attention,
    experts_kwargs,
    hf_config,
    require_transformers,
    stratagem_attention,
    wrap_causal_lm,
)
from runtime.models.init import init_weights

FIDELITY_TOLERANCE = 1e-5  # largest |logit difference| in fp32 that still counts as the same model
TINY = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 256}
TINY_TOKENS, TINY_BATCH, SEED = 12, 2, 0
MAX_TINY_PARAMS = 20_000_000  # a tiny instance above this was not shrunk (its sizes hide under other keys)


def _set(config, name: str, value) -> None:
    """Set ``name`` where the config has it (PretrainedConfig maps canonical names to the model's own, GPT-2's
    ``n_embd``); a derived, read-only one (Falcon's ``head_dim``) follows the others."""
    if hasattr(config, name):
        try:
            setattr(config, name, value)
        except AttributeError:
            pass


def _first_line(exc: Exception) -> str:
    """``Type: first line of the message`` (at most 160 characters of it), for a one-line refusal."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0][:160]}" if text else type(exc).__name__


def _is_causal(model: nn.Module, ids: torch.Tensor) -> bool:
    """Whether the logits of the first tokens ignore the last one (changed): what a causal LM is, by mechanism."""
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % TINY["vocab_size"]
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, model(input_ids=changed).logits
    return _max_diff(a[:, :-1], b[:, :-1]) <= FIDELITY_TOLERANCE


def tiny_config(config):
    """``config`` with its structure kept and its sizes shrunk: 64 hidden, 4 heads (the key/value heads keep their
    grouping where they can), head size 16, 128 FFN, 256 tokens, as many layers as it takes to hold one of each
    layer type (at least 2, at most 8), at most 4 experts with top-2 routing."""
    tiny = copy.deepcopy(config)
    heads = getattr(config, "num_attention_heads", None) or 4
    kv = getattr(config, "num_key_value_heads", None) or heads
    for name, value in TINY.items():
        _set(tiny, name, value)
    _set(tiny, "num_key_value_heads", 4 if kv >= heads else max(1, 4 // max(1, heads // max(kv, 1))))
    _set(tiny, "head_dim", 16)
    head_dim = getattr(config, "head_dim", None) or (getattr(config, "hidden_size", 0) // heads if heads else 0)
    for name in ("word_embed_proj_dim",):  # OPT: projections around the blocks only where it differs from hidden
        value = getattr(config, name, None)
        if isinstance(value, int):
            setattr(tiny, name, TINY["hidden_size"] if value == getattr(config, "hidden_size", None) else 32)
    rotary_dim = getattr(config, "rotary_dim", None)
    if isinstance(rotary_dim, int) and head_dim:  # a partial rotary (GPT-J, CodeGen): keep its share of the head
        tiny.rotary_dim = max(2, 2 * round(rotary_dim * 16 / head_dim / 2))
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size", "n_inner", "ffn_dim"):
        if getattr(tiny, name, None):
            setattr(tiny, name, 128)
    for name in ("num_local_experts", "num_experts", "n_routed_experts"):
        if getattr(tiny, name, None):
            setattr(tiny, name, min(getattr(tiny, name), 4))
    if getattr(tiny, "num_experts_per_tok", None):
        tiny.num_experts_per_tok = min(tiny.num_experts_per_tok, 2)
    _shrink_layers(config, tiny)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(tiny, name, None)
        if isinstance(value, int) and value >= TINY["vocab_size"]:
            setattr(tiny, name, TINY["vocab_size"] - 1)
    return tiny


def _shrink_layers(config, tiny) -> None:
    """As many layers as it takes to hold one of each layer kind (at least 2, at most 8), and every per-layer
    setting cut to them."""
    per_layer = _per_layer_lists(config)  # layer_types, mlp_layer_types, ...: one entry per layer
    layers = max([2] + [values.index(t) + 1 for values in per_layer.values() for t in set(values)])
    layers = min(layers, 8, getattr(config, "num_hidden_layers", None) or layers)
    _set(tiny, "num_hidden_layers", layers)
    for name, values in per_layer.items():  # cut to the layers kept, or transformers rejects the config's dict
        _set(tiny, name, values[:layers])
    n = getattr(config, "num_hidden_layers", None)
    for name, value in vars(config).items():
        if name.endswith("heads_per_layer") and isinstance(value, list) and len(value) == n:
            _set(tiny, name, [getattr(tiny, "num_attention_heads", 4)] * layers)  # Laguna: heads of each layer
    pattern = getattr(config, "attention_types", None)
    if (  # GPT-Neo's [[kinds, repeats]]: one repeat of the kinds, as many layers as the kinds
        isinstance(pattern, list)
        and len(pattern) == 1
        and isinstance(pattern[0], list)
        and len(pattern[0]) == 2
        and isinstance(pattern[0][0], list)
    ):
        _set(tiny, "num_hidden_layers", len(pattern[0][0]))
        _set(tiny, "attention_types", [[list(pattern[0][0]), 1]])
        _set(tiny, "attention_layers", list(pattern[0][0]))


def _per_layer_lists(config) -> dict[str, list]:
    """The config's per-layer lists of layer kinds (strings), one entry per hidden layer: ``layer_types`` and the
    like (Cohere2-MoE's ``mlp_layer_types``)."""
    n = getattr(config, "num_hidden_layers", None)
    out = {}
    for name, value in vars(config).items():
        if (
            name.endswith(("_types", "_layers"))
            and isinstance(value, list)
            and value
            and (n is None or len(value) == n)
            and all(isinstance(v, str) for v in value)
        ):
            out[name] = list(value)
    return out


def _tiny_params(transformers, config) -> int:
    """Parameters of the tiny instance, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, **experts_kwargs(config))
    return sum(p.numel() for p in model.parameters())


def _build(transformers, config, attention: str) -> nn.Module:
    """A CPU instance with its own copy of ``config``: transformers keeps the config object it is given as
    ``model.config`` and records the attention implementation on it, so two models built from one object both run
    the second one's attention (the reference then ran Stratagem's, and no attention difference could show)."""
    torch.manual_seed(SEED)
    config = copy.deepcopy(config)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attention, dtype=torch.float32, **experts_kwargs(config)
    )
    return model.eval()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    return float((a - b).abs().max())


def _first_difference(wrapped, ids: torch.Tensor, hidden: tuple[torch.Tensor, ...]) -> str:
    """The first part whose output differs from transformers' hidden states (the last of which may already be
    normalised, so the part after the last layer is named as such)."""
    x = wrapped.embed(ids)
    if not _max_diff(x, hidden[0]) <= FIDELITY_TOLERANCE:  # NaN counts as a difference
        return "the embedding (token, position or scaling)"
    blocks = list(wrapped.blocks.values())
    for i, block in enumerate(blocks[:-1]):
        x = block(x)
        if not _max_diff(x, hidden[i + 1]) <= FIDELITY_TOLERANCE:
            return f"decoder layer {i} ({type(block.layer).__name__})"
    return "the last decoder layer, the final norm or the LM head (its scaling or soft-capping)"


def _as_the_runtime_builds(wrapped: nn.Module) -> nn.Module:
    """A copy of ``wrapped`` allocated empty and initialised as ``build_chunk`` does (``to_empty``, then
    ``init_weights``: seeded weights, transformers' ``_init_weights`` for buffers and norms), then given
    ``wrapped``'s parameters, so only what the runtime itself sets (buffers, constants) can differ; a buffer left
    uninitialised (Apertus' xIELU ``beta``/``eps``) shows here and not in a model built on the CPU."""
    model = copy.deepcopy(wrapped)
    model.to_empty(device="cpu")
    init_weights(model, seed=SEED)
    source = dict(wrapped.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, param in model.named_parameters(remove_duplicate=False):
            param.copy_(source[name])
    return model.eval()


def check_hf_fidelity(spec: ModelSpec) -> Fidelity:
    """Build a tiny instance of the ``hf:`` model both ways and compare their logits (see the module docstring);
    the :class:`Fidelity` record, or a one-line :class:`StratagemError` naming the part that differs."""
    transformers = require_transformers()
    start = time.perf_counter()
    config = hf_config(spec)
    not_causal = StratagemError(
        f"{spec.source}: model_type {config.model_type!r} is not a causal language model (its first tokens' logits "
        f"depend on later tokens, or transformers has no AutoModelForCausalLM for it); plan a decoder-only causal LM"
    )
    if type(config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise not_causal
    name = type(config).__name__.removesuffix("Config")
    try:
        tiny = tiny_config(config)
    except Exception as exc:  # noqa: BLE001 - configs with per-layer or derived sizes refuse the canonical names
        raise StratagemError(
            f"{spec.source}: the fidelity check cannot shrink {name}'s config ({_first_line(exc)}); "
            f"this architecture is not supported, plan another model"
        ) from None
    try:
        params = _tiny_params(transformers, tiny)
        if params > MAX_TINY_PARAMS:  # a size this config names in keys tiny_config does not know
            raise StratagemError(
                f"{spec.source}: the fidelity check cannot shrink {name} (its tiny instance still has {params:,} "
                f"parameters, more than {MAX_TINY_PARAMS:,}: its sizes use config keys Stratagem does not know); "
                f"this architecture is not supported, plan another model"
            )
        reference = _build(transformers, tiny, "eager")
        ids = torch.randint(
            0, TINY["vocab_size"], (TINY_BATCH, TINY_TOKENS), generator=torch.Generator().manual_seed(SEED)
        )
        if not _is_causal(reference, ids):
            raise not_causal
        transformers.AttentionInterface.register(ATTENTION, stratagem_attention)
        try:
            torch.manual_seed(SEED)
            ours = build_with_attention(transformers, tiny).eval()
        except (KeyError, ValueError):
            raise StratagemError(
                f"{spec.source}: {name} computes attention in its own forward and refuses an attention function "
                f"from transformers' AttentionInterface, which is how Stratagem runs attention; plan another model"
            ) from None
        ours.load_state_dict(reference.state_dict())
        wrapped, _ = wrap_causal_lm(ours, spec)
        with torch.no_grad():
            expected = reference(input_ids=ids, output_hidden_states=True)
            got = wrapped(ids)
            diff = _max_diff(got, expected.logits)
            where = "" if diff <= FIDELITY_TOLERANCE else _first_difference(wrapped, ids, expected.hidden_states)
            if diff <= FIDELITY_TOLERANCE:  # the same weights in a model materialised as the runtime does it
                materialised = _as_the_runtime_builds(wrapped)
                diff = _max_diff(materialised(ids), expected.logits)
                if not diff <= FIDELITY_TOLERANCE:
                    part = _first_difference(materialised, ids, expected.hidden_states)
                    where = f"{part}, after the runtime's to_empty and init: a buffer it does not initialise"
    except StratagemError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of a foreign architecture becomes the one-line refusal
        raise StratagemError(
            f"{spec.source}: Stratagem's wrapper cannot run {name} ({_first_line(exc)}); this "
            f"architecture is not supported, plan another model"
        ) from None
    if not diff <= FIDELITY_TOLERANCE:
        raise StratagemError(
            f"{spec.source}: Stratagem's wrapper of {name} computes other logits than transformers on the same "
            f"weights (max |difference| {diff:.3g} > {FIDELITY_TOLERANCE:g} in fp32; first at {where}); this "
            f"architecture needs support Stratagem lacks, plan another model"
        )
    return Fidelity(
        max_abs_logit_diff=diff,
        tolerance=FIDELITY_TOLERANCE,
        layers=len(cast(nn.ModuleDict, wrapped.blocks)),
        transformers_version=transformers.__version__,
        seconds=round(time.perf_counter() - start, 3),
    )
