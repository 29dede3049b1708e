"""Expert parallelism for ``hf:`` Mixture-of-Experts models (Mixtral, Qwen2-MoE, Qwen3-MoE).

transformers 5 stores a sparse block's routed experts fused: one ``experts`` module holding ``gate_up_proj``
(E, 2 * I, H) and ``down_proj`` (E, H, I), called as ``experts(hidden_states, top_k_index, top_k_weights)``
after the block's own router (``MixtralTopKRouter``: softmax -> top-k -> renormalise; ``Qwen2MoeTopKRouter`` /
``Qwen3MoeTopKRouter``: softmax -> top-k, renormalised when ``norm_topk_prob``; Qwen2-MoE then adds its
shared expert times ``sigmoid(shared_expert_gate(x))``). Only that ``experts`` module is replaced here, by
:class:`HFLocalExperts`: the router, the shared expert and its gate stay transformers' own code, so each
model keeps its routing math and only where the experts run changes.

:class:`HFLocalExperts` holds the ``experts / ep`` experts of this rank's ep position (global indices
``[i * E/ep, (i+1) * E/ep)``, the zoo's layout, ``runtime.executor.moe``), one parameter per expert keyed by
its global index (``...mlp.experts.gate_up_proj.5``), so a DCP checkpoint has one entry per expert (a fused
tensor holding different experts on different ranks under one name would collide; under etp one per slice,
``runtime.executor.etp_keys``) and the seeded init, done on the whole fused tensor before sharding, is the
single process's. Its forward sorts the (token, choice) assignments by expert
(``runtime.models.moe.sort_by_expert``), dispatches the rows over the ep group and combines them with
``runtime.executor.moe_dispatch.ExpertExchange`` (counts, then rows, ``all_to_all_single`` both ways, the
backward the reverse exchange), runs each local expert as transformers' fused-experts forward
does (``linear(x, gate_up_proj[e])`` split into gate and up, ``act(gate) * up``, ``linear(., down_proj[e])``),
and sums the outputs weighted by the router's ``top_k_weights``, as transformers' forward does.

The rank layout, the gradient rule (expert gradients summed over edp and divided by dp) and ZeRO over edp are
the zoo's (``runtime.executor.moe``: ``ExpertGradSync``, ``apply_expert_dp``), and so is expert tensor
parallelism (etp: each expert's FFN width split over the etp group, :class:`HFLocalExperts`). Not run for hf:
models (one-line refusals in :func:`check_hf_experts`): expert layouts with tp > 1 (no Megatron layout is derived
for a block holding fused expert weights, ``runtime.models.external``), a capacity factor (transformers' blocks
are dropless), and fused experts of another form (biases, transposed or interleaved weights, a custom gate, e.g.
gpt-oss).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from planner.core import StratagemError
from planner.plan import Plan
from runtime.executor.etp_keys import mark_etp_slice
from runtime.models.llama import recompute_in_backward
from runtime.models.moe import Routing, sort_by_expert

# transformers' ``use_experts_implementation`` flags (integrations/moe.py) of the one layout run here
_PLAIN_LAYOUT = {
    "has_gate": True,
    "has_bias": False,
    "is_transposed": False,
    "is_concatenated": True,
    "has_post_expert_norm": False,
}


def fused_experts(model: nn.Module) -> dict[str, nn.Module]:
    """Path -> transformers fused-experts module (3D ``gate_up_proj`` and ``down_proj``) in ``model``."""
    out = {}
    for path, m in model.named_modules():
        gate_up, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
        if isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3:
            out[path] = m
    return out


def fused_weight(m: nn.Module, name: str) -> torch.Tensor:
    """``m.gate_up_proj`` or ``m.down_proj`` of a module :func:`fused_experts` found (it checked both are tensors)."""
    return cast(torch.Tensor, getattr(m, name))


def _unsupported(m: nn.Module) -> str:
    """Why ``m`` is not the plain fused SwiGLU layout :class:`HFLocalExperts` runs ("" = it is)."""
    flags = {k: getattr(m, k, v) for k, v in _PLAIN_LAYOUT.items()}
    wrong = [f"{k}={v}" for k, v in flags.items() if v != _PLAIN_LAYOUT[k]]
    gate = getattr(type(m), "_apply_gate", None)
    if gate is not None and getattr(gate, "__name__", "") != "_default_apply_gate":
        wrong.append("a custom _apply_gate")
    extra = sorted({n for n, _ in m.named_parameters()} - {"gate_up_proj", "down_proj"})
    if extra:
        wrong.append(f"parameters {', '.join(extra)}")
    return ", ".join(wrong)


def check_hf_experts(plan: Plan) -> None:
    """One-line errors, before any process starts, for hf: expert layouts the runtime cannot run."""
    from runtime.models.external import external

    lay = plan.experts
    assert lay is not None
    name = plan.model.name
    layers = fused_experts(external(plan.model).template)
    if not layers:
        raise StratagemError(
            f"the plan sets experts (ep={lay.ep}) but {name} has no fused routed experts "
            f"(transformers' gate_up_proj / down_proj); re-plan without them"
        )
    for path, m in layers.items():
        why = _unsupported(m)
        if why:
            raise StratagemError(
                f"{name}: the experts at {path} ({type(m).__name__}: {why}) are not the plain fused SwiGLU "
                f"layout the runtime shards over ep and etp; plan it with ep 1 and etp 1"
            )
    experts = int(fused_weight(next(iter(layers.values())), "gate_up_proj").shape[0])
    if experts % lay.ep:
        divisors = [d for d in range(1, experts + 1) if experts % d == 0]
        raise StratagemError(f"experts={experts} of {name} is not divisible by ep={lay.ep}; choose ep among {divisors}")
    width = int(fused_weight(next(iter(layers.values())), "down_proj").shape[-1])
    if width % lay.etp:
        raise StratagemError(
            f"etp={lay.etp} does not divide the expert width {width} of {name}; choose etp dividing {width}"
        )
    dp, tp = plan.mesh.size("dp"), plan.mesh.size("tp")
    if tp > 1:
        raise StratagemError(
            f"{name} with ep={lay.ep} and tp={tp}: hf: MoE blocks have no tensor-parallel layout, so every TP "
            f"rank would dispatch the same tokens; re-plan with tp 1"
        )
    if dp % (lay.ep * lay.etp):
        raise StratagemError(
            f"ep={lay.ep} x etp={lay.etp} does not divide a stage's dp={dp} ranks; choose ep x etp dividing {dp}"
        )
    if lay.capacity_factor:
        raise StratagemError(
            f"capacity_factor={lay.capacity_factor}: transformers' MoE blocks of {name} are dropless; "
            f"set it to null (dropless)"
        )
    if plan.batch_shares is not None and len(set(plan.schedule.micro_batches_per_replica or [])) > 1:
        raise StratagemError(  # every ep/etp group spans dp replicas here (tp 1), as in runtime.executor.moe
            "expert all-to-alls span dp replicas whose batch shares give them different micro-batch counts, "
            "which would deadlock; use equal batch shares"
        )


class HFLocalExperts(nn.Module):
    """This rank's experts of one hf sparse block, in place of transformers' fused ``experts`` module (same
    call: ``(hidden_states (n, h), top_k_index (n, k), top_k_weights (n, k)) -> (n, h)``). With ``etp`` > 1 each
    expert keeps its ``etp_index``-th slice of the FFN width I: those rows of the gate and of the up projection
    (stored [gate slice; up slice], so the forward's split into gate and up still holds) and those columns of
    ``down_proj`` (Megatron's MLP split inside each expert, as ``moe_dispatch.shard_expert_ffn`` does for the zoo);
    ``ExpertExchange`` sums the etp peers' partial outputs."""

    def __init__(self, fused: nn.Module, mine: list[int], exchange=None, *, etp: int = 1, etp_index: int = 0) -> None:
        super().__init__()
        self.num_experts = int(fused_weight(fused, "gate_up_proj").shape[0])  # global E (the router's)
        gate_up, down = fused_weight(fused, "gate_up_proj").detach(), fused_weight(fused, "down_proj").detach()
        inter = down.shape[-1]  # I: gate rows [0, I), up rows [I, 2I) of gate_up_proj[e]
        part = slice(etp_index * inter // etp, (etp_index + 1) * inter // etp)
        self.gate_up_proj = nn.ParameterDict(
            {str(j): nn.Parameter(torch.cat([gate_up[j, :inter][part], gate_up[j, inter:][part]])) for j in mine}
        )
        self.down_proj = nn.ParameterDict({str(j): nn.Parameter(down[j][:, part].clone()) for j in mine})
        self.act_fn = cast(nn.Module, fused.act_fn)  # transformers' ACT2FN activation module
        if etp > 1:
            mark_etp_slice(self, etp_index, etp)  # its own checkpoint keys (runtime.executor.etp_keys)
        self.exchange = exchange  # ExpertExchange over the ep group; None = every expert of the layer is here

    def run_grouped(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows grouped by local expert (``counts[j]`` for the j-th held) through their experts, in order
        (transformers' fused-experts math, ``_default_apply_gate``). ``act(gate) * up`` is recomputed in the
        backward, as the zoo's SwiGLU is (``runtime.models.llama.recompute_in_backward``): the same values, one
        ``rows x f`` tensor fewer saved per expert (what ``planner.cost.moe`` prices)."""
        outs = []
        for key, chunk in zip(self.gate_up_proj.keys(), rows.split(counts.tolist())):
            gate, up = F.linear(chunk, self.gate_up_proj[key]).chunk(2, dim=-1)
            outs.append(F.linear(recompute_in_backward(self._gated, gate, up), self.down_proj[key]))
        return torch.cat(outs)

    def _gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act_fn(gate) * up

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        n, k = top_k_index.shape
        h = hidden_states.shape[-1]
        kept = torch.ones_like(top_k_index, dtype=torch.bool)
        routing = Routing(experts=top_k_index, weights=top_k_weights, kept=kept, aux_loss=hidden_states.new_zeros(()))
        order, token_of, counts = sort_by_expert(routing, self.num_experts)
        rows = hidden_states[token_of]
        routed = self.exchange(rows, counts, self, 0) if self.exchange is not None else self.run_grouped(rows, counts)
        slots = routed.new_zeros(n * k, h).index_copy(0, order, routed)  # back to (token, choice) order
        return (slots.view(n, k, h) * top_k_weights.unsqueeze(-1).to(slots.dtype)).sum(dim=1).to(hidden_states.dtype)


def apply_hf_ep(model: nn.Module, groups) -> dict[str, list[int]]:
    """Replace every fused experts module of ``model`` (an hf: pipeline chunk) by this rank's
    :class:`HFLocalExperts`; returns sparse-block path -> global experts held ({} for a model without them)."""
    from runtime.executor.moe_dispatch import ExpertExchange

    held = {}
    for path, fused in fused_experts(model).items():
        per_rank = int(fused_weight(fused, "gate_up_proj").shape[0]) // groups.ep
        mine = list(range(groups.ep_index * per_rank, (groups.ep_index + 1) * per_rank))
        exchange = None
        if groups.ep > 1 or groups.etp > 1:
            exchange = ExpertExchange(group=groups.ep_group, ep=groups.ep, etp_group=groups.etp_group, etp=groups.etp)
        parent, _, name = path.rpartition(".")
        local = HFLocalExperts(fused, mine, exchange, etp=groups.etp, etp_index=groups.etp_index)
        setattr(model.get_submodule(parent), name, local)
        held[parent] = mine
    return held


def hf_local_experts(model: nn.Module) -> list[HFLocalExperts]:
    return [m for m in model.modules() if isinstance(m, HFLocalExperts)]
