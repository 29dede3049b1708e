"""Checkpoint keys of expert tensor parallelism (etp): one key per etp slice of an expert's FFN.

Under etp > 1 the etp peers of an expert hold different slices of its FFN (``moe_dispatch.shard_expert_ffn``,
``hf_moe.HFLocalExperts``) under the one parameter name. torch.distributed.checkpoint keys tensors by name and
takes same-named plain tensors (and same-offset DTensor shards) on several ranks for replicas, so it would write
one peer's slice and load it on every peer. Here each slice gets its own key: the parameter's FQN with
``.etp<i>_of_<etp>`` appended in the model state, and the same FQN renamed inside the flattened optimizer keys
(``state.<fqn>.exp_avg`` -> ``state.<fqn>.etp0_of_2.exp_avg``, ``param_groups.<fqn>.lr`` likewise). The ranks
sharing a key are then the slice's edp copies: identical plain tensors (ZeRO-0) or the edp shards of one DTensor
(ZeRO >= 1, ``moe.apply_expert_dp``), which DCP writes and reads as it does any other parameter.

The sliced modules carry the marker :data:`ETP_SLICE` = ``(etp_index, etp)``, set where the slice is cut, on the
module rather than on its parameters because ``fully_shard`` replaces the parameters (and their attributes).
"""

from __future__ import annotations

import re

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

from planner.core import StratagemError

ETP_SLICE = "etp_slice"  # module attribute: (etp_index, etp) of the FFN slice its parameters hold
_OPTIM_PREFIXES = ("state.", "param_groups.")


def mark_etp_slice(module: nn.Module, etp_index: int, etp: int) -> None:
    """Record on ``module`` that every parameter under it is the ``etp_index``-th of ``etp`` slices."""
    setattr(module, ETP_SLICE, (etp_index, etp))


def etp_sliced_fqns(model: nn.Module, state_keys: set[str]) -> dict[str, str]:
    """FQN -> its checkpoint key, for every parameter of ``model`` under a module marked :data:`ETP_SLICE`.

    FQNs are the state dict's (``get_model_state_dict``: recompute's checkpoint wrapper prefix stripped);
    ``state_keys`` are that state dict's keys, and a sliced FQN missing from them is a bug, not a silent skip.
    """
    out = {}
    for path, module in model.named_modules():
        mark = getattr(module, ETP_SLICE, None)
        if mark is None:
            continue
        index, etp = mark
        for name, _ in module.named_parameters(prefix=path):
            fqn = name.replace(_CHECKPOINT_PREFIX, "")
            if fqn not in state_keys:
                raise StratagemError(
                    f"etp-sliced parameter {fqn} is not in the model's state dict; the checkpoint would drop it "
                    f"(a runtime bug: report it, and launch without --checkpoint-dir meanwhile)"
                )
            out[fqn] = f"{fqn}.etp{index}_of_{etp}"
    return out


def model_key(sliced: dict[str, str], key: str) -> str:
    """The checkpoint key of the model state entry ``key``."""
    return sliced.get(key, key)


def optim_key(sliced: dict[str, str], key: str) -> str:
    """The checkpoint key of the flattened optimizer entry ``key`` (``state.<fqn>.<name>``,
    ``param_groups.<fqn>.<name>``); the FQN is the longest sliced one the key starts with."""
    if not sliced:
        return key
    for prefix in _OPTIM_PREFIXES:
        if key.startswith(prefix):
            rest = key[len(prefix) :]
            fqn, _, name = rest.rpartition(".")
            while fqn and fqn not in sliced:
                fqn, _, head = fqn.rpartition(".")
                name = f"{head}.{name}"
            if fqn:
                return f"{prefix}{sliced[fqn]}.{name}"
    return key


# Resharding across etp: where each sliced parameter's slice lies in the whole expert weight, by the parameter's
# name (the slicing code is moe_dispatch.shard_expert_ffn for the zoo, hf_moe.HFLocalExperts for hf: models):
# (dim, blocks): the weight is `blocks` equal parts along `dim`, each cut into etp slices, and an etp rank's
# slice is its piece of every part, concatenated (hf's gate_up_proj rows are [gate; up]: 2 blocks).
_SLICE_RULES = (
    (re.compile(r"\.w[13]\.weight(\.|$)"), (0, 1)),  # zoo SwiGLU: rows of w1 and w3
    (re.compile(r"\.w2\.weight(\.|$)"), (1, 1)),  # columns of w2
    (re.compile(r"\.gate_up_proj\.\d+(\.|$)"), (0, 2)),  # hf: rows of the gate and of the up projection
    (re.compile(r"\.down_proj\.\d+(\.|$)"), (1, 1)),  # hf: columns of down_proj
)
_SLICE_KEY = re.compile(r"\.etp(\d+)_of_(\d+)(?=\.|$)")


def slice_rule(key: str) -> tuple[int, int]:
    """``(dim, blocks)`` of the etp-sliced parameter that checkpoint entry ``key`` (the parameter, or its AdamW
    state) belongs to (:data:`_SLICE_RULES`)."""
    for pattern, rule in _SLICE_RULES:
        if pattern.search(key):
            return rule
    raise StratagemError(
        f"no etp slicing rule for checkpoint entry {key}; the checkpoint cannot be resharded to another etp "
        f"(resume with the etp that wrote it)"
    )


def split_key(key: str) -> tuple[str, int, int]:
    """``(key without its slice, slice index, slices)`` of a checkpoint key; ``(key, 0, 1)`` when not sliced.

    >>> split_key("optim.state.blocks.1.moe.experts.3.w2.weight.etp1_of_2.exp_avg")
    ('optim.state.blocks.1.moe.experts.3.w2.weight.exp_avg', 1, 2)
    """
    m = _SLICE_KEY.search(key)
    if m is None:
        return key, 0, 1
    return key[: m.start()] + key[m.end() :], int(m.group(1)), int(m.group(2))


def take_slice(whole: torch.Tensor, rule: tuple[int, int], index: int, etp: int) -> torch.Tensor:
    """Slice ``index`` of ``etp`` of a whole expert weight (or its AdamW state)."""
    dim, blocks = rule
    return torch.cat([b.chunk(etp, dim)[index] for b in whole.chunk(blocks, dim)], dim)


def join_slices(parts: list[torch.Tensor], rule: tuple[int, int]) -> torch.Tensor:
    """The whole weight from its ``len(parts)`` etp slices, in order (inverse of :func:`take_slice`)."""
    dim, blocks = rule
    pieces = [p.chunk(blocks, dim) for p in parts]
    return torch.cat([torch.cat([p[b] for p in pieces], dim) for b in range(blocks)], dim)
