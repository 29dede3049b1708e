"""``launch --init-from DIR``: start training from the weights in a safetensors checkpoint, in the planned layout.

DIR holds ``*.safetensors`` files, sharded (with ``model.safetensors.index.json``, as transformers'
``save_pretrained`` writes a large model) or not. For a ``hf:`` model the tensor names are transformers' own
(``model.layers.0.self_attn.q_proj.weight``); the wrapper's paths (``blocks.0.layer.self_attn.q_proj.weight``) are
mapped onto them through the parts :func:`runtime.models.hf.find_parts` found (a tied LM head reads the token
embedding's tensor, which transformers saves once). A zoo model reads its own parameter names (its
``state_dict()`` saved with ``safetensors.torch.save_file``, a tied head's ``head.weight`` left out as
transformers leaves it out).

Before any process starts, :func:`check_init_from` reads only the files' JSON headers and compares every parameter
of the plan's model with the checkpoint: a missing tensor, another shape, a missing shard or a torn header is one
line naming it. In the ranks, :func:`load_pretrained` loads through ``torch.distributed.checkpoint`` with its
``HuggingFaceStorageReader`` (collective, after the chunks are sharded and before the optimizers exist): each rank
asks only for the tensors of its pipeline stage and, for a tensor-parallel or ZeRO-3 shard, only its slice, which
the reader reads from the file. Values are converted to the parameters' dtype. Not supported yet, each refused in
one line: expert parallelism (ep or etp > 1: the runtime holds experts per expert, not as transformers' fused
tensor), and transformers' models whose saved layout differs from the one they train in (its
``conversion_mapping``, e.g. Mixtral's per-expert ``w1``/``w2``/``w3``).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from planner.core import StratagemError
from planner.model import ModelSpec
from planner.plan import Plan
from runtime.executor.checks import expert_layout
from runtime.models import build_model
from runtime.models.hf import hf_conversion_mapping, hf_parts

INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own limit on a header
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


@dataclass(frozen=True, slots=True)
class StoredTensor:
    shape: tuple[int, ...]
    dtype: str
    file: str


def _header(path: Path) -> dict[str, StoredTensor]:
    """The tensors a safetensors file holds, from its JSON header (8-byte little-endian length, then JSON)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            size = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if not 0 < size <= MAX_HEADER_BYTES:
                raise ValueError(f"header length {size} is not a safetensors header")
            header = json.loads(f.read(size))
            f.seek(0, 2)
            data_bytes = f.tell() - 8 - size
        out = {}
        for key, info in header.items():
            if key == "__metadata__":
                continue
            shape, (start, end) = tuple(int(d) for d in info["shape"]), info["data_offsets"]
            if end > data_bytes or end - start != math.prod(shape) * _DTYPE_BYTES.get(info["dtype"], 0):
                raise ValueError(f"tensor {key!r} runs past the end of the file (torn or truncated)")
            out[key] = StoredTensor(shape=shape, dtype=str(info["dtype"]), file=path.name)
        return out
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StratagemError(
            f"--init-from: {path} is not a readable safetensors file ({str(exc).splitlines()[0][:160]}); "
            f"save the model again (transformers: save_pretrained)"
        ) from None


def checkpoint_tensors(folder: str | Path) -> dict[str, StoredTensor]:
    """Every tensor of the safetensors checkpoint in ``folder``; a shard the index names but the folder lacks, or
    a tensor in two files, is an error."""
    folder = Path(folder)
    if not folder.is_dir():
        raise StratagemError(f"--init-from {folder} is not a folder; give the folder holding the *.safetensors files")
    files = sorted(folder.glob("*.safetensors"))
    index = folder / INDEX_FILE
    if index.exists():
        try:
            named = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise StratagemError(f"--init-from: {index} is not a safetensors index (no weight_map)") from None
        missing = [n for n in named if not (folder / n).is_file()]
        if missing:
            raise StratagemError(
                f"--init-from {folder}: {len(missing)} of the {len(named)} shards its {INDEX_FILE} names are missing "
                f"(first: {missing[0]}); copy the whole checkpoint folder"
            )
    if not files:
        raise StratagemError(f"--init-from {folder} holds no *.safetensors file; save the model with safetensors")
    out: dict[str, StoredTensor] = {}
    for path in files:
        for key, info in _header(path).items():
            if key in out:
                raise StratagemError(f"--init-from {folder}: tensor {key!r} is in both {out[key].file} and {path.name}")
            out[key] = info
    return out


def key_map(spec: ModelSpec) -> Callable[[str], str]:
    """Parameter path in the model the runtime builds -> its name in the checkpoint. A tied LM head reads the token
    embedding's tensor (saved once)."""
    if spec.family != "hf":
        tied = bool(getattr(build_model(spec, device="meta"), "tie_embeddings", False))
        return lambda fqn: "embed.tok.weight" if tied and fqn == "head.weight" else fqn
    parts = hf_parts(spec)
    prefixes = [("embed.tok.", parts.tok + "."), ("norm.", f"{parts.norm}."), ("head.", parts.head + ".")]
    if parts.pos:
        prefixes.append(("embed.pos.", parts.pos + "."))
    if parts.emb_norm:
        prefixes.append(("embed.norm.", parts.emb_norm + "."))

    def to_checkpoint(fqn: str) -> str:
        if parts.tied and fqn == "head.weight":
            return parts.tok + ".weight"  # transformers saves a tied head once, as the token embedding
        if fqn.startswith("blocks."):
            index, rest = fqn[len("blocks.") :].split(".", 1)
            return f"{parts.blocks}.{index}.{rest.removeprefix('layer.')}"
        for ours, theirs in prefixes:
            if fqn.startswith(ours):
                return theirs + fqn[len(ours) :]
        return fqn

    return to_checkpoint


def _clean(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def check_init_from(folder: str | Path, plan: Plan) -> int:
    """Every parameter of the plan's model is in the checkpoint with its shape (collective-free; run before the
    launch). Returns the number of checkpoint tensors the model reads."""
    lay = expert_layout(plan)
    if lay.ep > 1 or lay.etp > 1:
        raise StratagemError(
            f"--init-from with expert parallelism (ep={lay.ep} etp={lay.etp}) is not supported yet: the runtime "
            f"holds each expert apart, the checkpoint holds them fused; start from the weights with ep 1 and etp 1"
        )
    stored = checkpoint_tensors(folder)
    to_checkpoint = key_map(plan.model)
    model = build_model(plan.model, device="meta")
    wanted = {to_checkpoint(n): tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    missing = [k for k in wanted if k not in stored]
    if missing:
        why = "it is a checkpoint of another model, or of another version of it"
        if plan.model.family == "hf" and hf_conversion_mapping(plan.model):
            why = (
                "transformers saves this model type in another layout than it trains in (its conversion_mapping, "
                "e.g. per-expert tensors), which --init-from does not convert yet"
            )
        raise StratagemError(
            f"--init-from {folder} lacks {len(missing)} of the {len(wanted)} tensors of {plan.model.name} "
            f"(first: {missing[0]}): {why}"
        )
    for key, shape in wanted.items():
        if stored[key].shape != shape:
            raise StratagemError(
                f"--init-from {folder}: tensor {key!r} has shape {list(stored[key].shape)} but {plan.model.name} "
                f"has {list(shape)}; the checkpoint is of another model (plan the model it was saved from)"
            )
    return len(wanted)


def load_pretrained(folder: str | Path, chunks: list[nn.Module], spec: ModelSpec) -> None:
    """Collective: fill every parameter of this rank's ``chunks`` (sharded or not), and every persistent buffer the
    checkpoint holds, from the checkpoint."""
    to_checkpoint = key_map(spec)
    options = StateDictOptions()
    stored = checkpoint_tensors(folder)
    for chunk in chunks:
        params = {_clean(n) for n, _ in chunk.named_parameters(remove_duplicate=False)}
        full = get_model_state_dict(chunk, options=options)
        # every parameter, and the persistent buffers the checkpoint holds (constants such as xIELU's beta)
        mine = {fqn: t for fqn, t in full.items() if fqn in params or to_checkpoint(fqn) in stored}
        state = {to_checkpoint(fqn): t for fqn, t in mine.items()}
        with torch.no_grad():
            dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)))
        set_model_state_dict(chunk, {**full, **{fqn: state[to_checkpoint(fqn)] for fqn in mine}}, options=options)
