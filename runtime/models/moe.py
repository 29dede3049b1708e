"""Mixture-of-Experts decoder (the ``moe`` family): Llama attention and norms, routed SwiGLU experts.

Shaped like Mixtral (Jiang et al. 2024, arXiv:2401.04088), Qwen3-MoE and DeepSeek-V3 (arXiv:2412.19437):
the first ``dense_layers`` blocks are the ``llama`` family's dense blocks; every later block replaces
the FFN with :class:`MoE`:

- **Router** (Mixtral §2.1, HF ``MixtralSparseMoeBlock``): ``p = softmax(x W_g)`` over the E experts,
  the ``top_k`` largest kept and renormalised to sum to 1 (softmax -> top-k -> renormalise, which equals
  a softmax over the top-k logits). No jitter or noise, so routing is a pure function of the input.
- **Experts**: E SwiGLU FFNs of width ``expert_ffn`` (the llama :class:`FeedForward`), in an
  ``nn.ModuleDict`` keyed by global expert index, so expert parallelism keeps a rank's experts by
  deleting the others (as pipeline stages cut ``blocks``) and every parameter keeps its path
  (``blocks.1.moe.experts.3.w1.weight``) for the seeded init and checkpoints.
- **Shared experts** (DeepSeekMoE, Dai et al. 2024 arXiv:2401.06066 §3.2): ``shared_experts`` always-on
  experts, run as one SwiGLU of width ``shared_experts * expert_ffn`` added to the routed output.
- **Capacity** (``capacity_factor`` c > 0): each expert takes at most ``C = ceil(c * s * k / E)``
  assignments per sequence of ``s`` tokens (Switch Transformer, Fedus et al. 2022 JMLR §2.2 "expert
  capacity"; GShard, Lepikhin et al. 2021 §2.2 / Algorithm 1); first choices have priority over second
  choices, then earlier tokens (GShard's top-1-then-top-2 order). A dropped assignment contributes
  nothing (the token passes through the residual). c = 0 is dropless (MegaBlocks, Gale et al. 2023).
  Capacity is counted per sequence, not per rank's batch as Megatron-Core does, so the result does not
  depend on how a batch is split over data-parallel ranks or micro-batches.
- **Load-balancing loss** (Switch Transformer eq. 4-6, GShard's top-k form as in Megatron-Core
  ``switch_load_balancing_loss_func``): ``aux = E * sum_i f_i * P_i`` with ``f_i`` the fraction of the
  ``s * k`` routing choices that picked expert ``i`` and ``P_i`` the mean router probability of ``i``;
  1.0 for perfectly uniform routing. It is computed per sequence and averaged over the sequences
  (DeepSeek-V3 §2.1.2 eq. 17-20, the sequence-wise form), which keeps it exact under any batch split.
  ``aux_loss_coef * aux`` enters the gradient through :class:`AuxLossAttach` (Megatron-Core's
  ``MoEAuxLossAutoScaler``): the forward returns the block output unchanged, the backward adds the
  coefficient times ``aux_loss_scale`` as the aux loss's gradient. So the reported training loss is the
  language-model loss alone (Megatron logs ``load_balancing_loss`` separately; :attr:`MoE.aux_loss_sum` and
  :attr:`MoE.aux_loss_count` accumulate it over training forwards, not recomputed ones or shape probes,
  for the runtime's ``moe_aux_loss`` metric) while the
  gradient is that of ``lm_loss + coef * aux``. ``aux_loss_scale`` is the factor the runtime applies to each
  micro-batch's loss (1 / micro-batches, a data-parallel share; 1.0 alone).

Expert parallelism replaces :attr:`MoE.exchange` (``runtime.executor.moe``); alone, the sorted token
rows go straight to the local experts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models.dims import MoEDims
from runtime.models.layered import LayeredModel, build_decoder
from runtime.models.llama import Attention, Block, FeedForward, RMSNorm, build_llama_layer

if TYPE_CHECKING:
    from runtime.executor.moe import TokenShard

# (rows sorted by global expert (n, h), assignments per global expert (E,), local experts, slots) -> outputs
# (n, h); slots: the fixed per-expert buffer rows of a capacity-limited layer (0 = dropless)
Exchange = Callable[[torch.Tensor, torch.Tensor, nn.ModuleDict, int], torch.Tensor]


@dataclass(frozen=True, kw_only=True, slots=True)
class Routing:
    """Per token (flattened ``b * s``) and choice: expert index, combine weight (0 when dropped), kept."""

    experts: torch.Tensor  # (n, k) int64
    weights: torch.Tensor  # (n, k), renormalised top-k probabilities, zero where dropped
    kept: torch.Tensor  # (n, k) bool
    aux_loss: torch.Tensor  # scalar: mean over sequences of E * sum_i f_i P_i


def capacity(capacity_factor: float, seq_len: int, top_k: int, experts: int) -> int:
    """Assignments one expert takes per sequence: ceil(c * s * k / E) (Switch §2.2); 0 = unlimited."""
    if capacity_factor <= 0:
        return 0
    return math.ceil(capacity_factor * seq_len * top_k / experts)


def _kept_within_capacity(experts: torch.Tensor, num_experts: int, cap: int) -> torch.Tensor:
    """(b, s, k) expert ids -> bool mask of the assignments inside each expert's per-sequence capacity.

    Priority: choice 0 of every token, in token order, then choice 1, ... (GShard Algorithm 1).
    """
    b, s, k = experts.shape
    one_hot = F.one_hot(experts.transpose(1, 2).reshape(b, k * s), num_experts)  # choice-major order
    position = (one_hot.cumsum(dim=1) * one_hot).sum(-1) - 1  # 0-based slot of each assignment in its expert
    return (position < cap).view(b, k, s).transpose(1, 2)


def route_tokens(logits: torch.Tensor, *, top_k: int, capacity_factor: float) -> Routing:
    """Top-k routing of (b, s, E) router logits (see the module docstring for every rule)."""
    b, s, num_experts = logits.shape
    probs = F.softmax(logits, dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)  # (b, s, k)
    weights = weights / weights.sum(dim=-1, keepdim=True)  # Mixtral's renormalisation
    cap = capacity(capacity_factor, s, top_k, num_experts)
    kept = _kept_within_capacity(experts, num_experts, cap) if cap else torch.ones_like(experts, dtype=torch.bool)
    weights = weights * kept
    with torch.no_grad():  # f_i: fraction of the s * k choices per sequence (constant in the gradient)
        fraction = F.one_hot(experts, num_experts).sum(dim=(1, 2)).to(probs.dtype) / (s * top_k)
    aux = (num_experts * (fraction * probs.mean(dim=1)).sum(-1)).mean()
    return Routing(
        experts=experts.reshape(b * s, top_k),
        weights=weights.reshape(b * s, top_k),
        kept=kept.reshape(b * s, top_k),
        aux_loss=aux,
    )


class AuxLossAttach(torch.autograd.Function):
    """Identity on ``output`` whose backward also gives ``aux_loss`` the gradient ``scale``
    (Megatron-Core ``moe_utils.MoEAuxLossAutoScaler``): adds ``scale * aux_loss`` to the objective without
    threading it through the pipeline to the loss function."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(aux_loss)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None


def sort_by_expert(routing: Routing, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kept assignments sorted by expert (stable: token order within an expert).

    Returns (assignment index into the flattened (n * k) choices, token row of each, count per expert (E,)).
    On the meta device (FLOP and memory counts without data) routing is taken as perfectly balanced.
    """
    if routing.experts.device.type == "meta":  # no data: every expert takes an equal share (balanced routing)
        n, k = routing.experts.shape
        base, extra = divmod(n * k, num_experts)
        order = torch.arange(n * k, device="meta")
        return order, order // k, torch.tensor([base + (j < extra) for j in range(num_experts)])
    flat_experts = routing.experts.flatten()
    chosen = routing.kept.flatten().nonzero().squeeze(1)
    order = chosen[torch.argsort(flat_experts[chosen], stable=True)]
    counts = torch.bincount(flat_experts[chosen], minlength=num_experts)
    return order, order // routing.experts.shape[1], counts


def run_local_experts(rows: torch.Tensor, counts: torch.Tensor, experts: nn.ModuleDict) -> torch.Tensor:
    """Rows grouped by expert (``counts[j]`` rows for the j-th expert held) through their experts, in order."""
    chunks = rows.split(counts.tolist())
    return torch.cat([expert(chunk) for expert, chunk in zip(experts.values(), chunks)])


def local_exchange(rows: torch.Tensor, counts: torch.Tensor, experts: nn.ModuleDict, slots: int = 0) -> torch.Tensor:  # noqa: ARG001 - Exchange API
    """One process holds every expert: no communication."""
    return run_local_experts(rows, counts, experts)


class MoE(nn.Module):
    """Router, routed experts, optional shared experts; (b, s, h) -> (b, s, h)."""

    def __init__(self, dims: MoEDims, tp: int = 1) -> None:
        super().__init__()
        self.num_experts, self.top_k = dims.experts, dims.top_k
        self.capacity_factor, self.aux_loss_coef = dims.capacity_factor, dims.aux_loss_coef
        self.router = nn.Linear(dims.hidden, dims.experts, bias=False)
        self.experts = nn.ModuleDict({str(j): FeedForward(dims.hidden, dims.expert_ffn) for j in range(dims.experts)})
        width = dims.shared_experts * dims.expert_ffn // tp  # one TP rank's shard (runtime.models.tp)
        self.shared = FeedForward(dims.hidden, width) if width else None
        # set by the runtime (runtime.executor.moe); the defaults are one process training alone
        self.aux_loss_scale = 1.0
        self.exchange: Exchange = local_exchange
        self.token_shard: TokenShard | None = None  # tensor parallelism: each TP rank routes its own token slice
        # over training forwards (a tensor, so no device sync per layer), reset by the reader
        self.aux_loss_sum: torch.Tensor | float = 0.0
        self.aux_loss_count = 0
        self.count_aux_loss = True  # off while the runtime probes shapes (runtime.executor.moe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shard = self.token_shard
        # the shared experts see the layer's input as it comes (under TP they are tensor-parallel themselves)
        shared = self.shared(x) if self.shared is not None else None
        everyone = x if shard is None else shard.routing_input(x)  # (b, s, h): every token of the micro-batch
        b, s, h = everyone.shape
        routing = route_tokens(self.router(everyone), top_k=self.top_k, capacity_factor=self.capacity_factor)
        tokens = everyone.reshape(b * s, h)
        if shard is not None:  # the tokens this rank computes, and their routing
            tokens, routing = shard.split(x, tokens, routing)
        order, token_of, counts = sort_by_expert(routing, self.num_experts)
        # with a capacity, no expert takes more than capacity * sequences of this micro-batch from any rank
        slots = capacity(self.capacity_factor, s, self.top_k, self.num_experts) * b
        routed = self.exchange(tokens[token_of], counts, self.experts, slots)
        # unpermute: outputs back to (token, choice) slots, dropped slots zero, then the weighted sum
        placed = routed.new_zeros(routing.experts.numel(), h).index_copy(0, order, routed)
        out = (placed.view(-1, self.top_k, h) * routing.weights.unsqueeze(-1).to(placed.dtype)).sum(dim=1)
        out = out.view(b, s, h) if shard is None else shard.output(out, b, s)
        if shared is not None:
            out = out + shared
        if self.count_aux_loss and self.training and torch.is_grad_enabled() and not _recomputing():
            self.aux_loss_sum = self.aux_loss_sum + routing.aux_loss.detach()
            self.aux_loss_count += 1
        if self.aux_loss_coef > 0 and self.training and torch.is_grad_enabled():
            out = AuxLossAttach.apply(out, routing.aux_loss, self.aux_loss_coef * self.aux_loss_scale)
        return out


def _recomputing() -> bool:
    """True inside a backward pass: activation checkpointing re-running this forward (counted once already)."""
    return torch._C._current_graph_task_id() != -1


class MoEBlock(nn.Module):
    """x + attn(ln1(x)), then x + moe(ln2(x)) (the llama block with the FFN routed)."""

    def __init__(self, dims: MoEDims, tp: int = 1) -> None:
        super().__init__()
        self.ln1 = RMSNorm(dims.hidden)
        self.attn = Attention(dims.llama, tp)
        self.ln2 = RMSNorm(dims.hidden)
        self.moe = MoE(dims, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


def build_moe_layer(dims: MoEDims, path: str, tp: int = 1) -> nn.Module:
    """One top-level layer (``embed``, ``blocks.i``, ``norm``, ``head``); ``tp`` > 1 shards attention, shared
    experts and a dense block's FFN as one TP rank holds them; routed experts are never split by ``tp``
    (each TP rank computes its 1/tp of the tokens through them: runtime.executor.moe)."""
    if path.startswith("blocks.") and dims.is_moe_block(int(path.split(".")[1])):
        return MoEBlock(dims, tp)
    if path.startswith("blocks."):
        return Block(dims.llama, tp)
    return build_llama_layer(dims.llama, path, tp)


def build_moe(dims: MoEDims) -> LayeredModel:
    """The whole MoE decoder; the head shares the token embedding's weight when ``tie_embeddings``."""
    return build_decoder(dims, build_moe_layer)


def moe_layers(model: nn.Module) -> dict[str, MoE]:
    """Module path -> :class:`MoE` of every routed FFN in ``model`` (a whole model or a pipeline chunk)."""
    return {
        path.replace("_checkpoint_wrapped_module.", ""): m for path, m in model.named_modules() if isinstance(m, MoE)
    }
