"""Distributed checkpoints (torch.distributed.checkpoint) that are either complete or ignored.

Layout: ``DIR/step_000004/`` holds the DCP shards, ``meta.json`` (:func:`checkpoint_meta`) and a ``COMPLETE``
marker. A save goes to ``DIR/step_000004.tmp/``; only after every rank has written its shards does rank
0 write ``meta.json`` and ``COMPLETE`` into it and rename it to ``DIR/step_000004`` (``os.replace``, atomic
on POSIX). A save killed half-way therefore leaves a ``.tmp`` folder (or, at worst, a folder without the
marker), which :func:`find_latest_checkpoint` never picks (a resume names it: :func:`torn_checkpoints`). The folders
are read without torch in :mod:`runtime.executor.checkpoint_dirs`.

What is saved: model and AdamW state of every pipeline chunk this rank holds (keys are full-model FQNs,
so chunks merge into one dict; ``flatten_optimizer_state_dict`` keys optimizer state by FQN too), the
step (= data position, see ``data``), and each rank's RNG state. DCP takes same-named tensors on several ranks
for copies of one tensor (or shards of it, by offset), which holds for every parameter but the FFN slices of an
expert under expert tensor parallelism (etp > 1): its etp peers hold different slices under one name. Those are
stored under keys naming the slice (``<fqn>.etp<i>_of_<etp>``, the optimizer's flattened keys likewise) and
mapped back when loading (:mod:`runtime.executor.etp_keys`); the ranks sharing such a key are the slice's edp
copies or shards, as for any other parameter.

Resharding: ``meta.json`` records the model (name, a digest of what builds it), the training settings, and the
layout that wrote it (world size, mesh, plan hash, ep and etp). Any plan of the same model and training settings
resumes it (:func:`check_compatible`; anything else is refused in one line): DCP reads each rank's own shard of
every entry whatever layout wrote it (whole tensors under dp and cp, DTensor offsets under tp and ZeRO, a stage's
FQNs under pp, experts by global index under ep), and an expert slice written under another etp is put together
from the written slices and cut again (:func:`load_checkpoint`). The data position is the step, so the same global
batch continues from the same sample. ``benchmarks/reshard_matrix.py`` checks every pair of layouts, tensor by
tensor. hf: MoE checkpoints cannot move between fused experts (no expert layout) and per-expert ones.

Loading is restricted (the checkpoint folder is user input): torch 2.13's ``FileSystemReader`` reads DCP's
``.metadata`` with a plain ``pickle.load`` and ``DefaultLoadPlanner.load_bytes`` uses
``torch.load(weights_only=False)`` for non-tensor entries (AdamW's param_groups), see pytorch/pytorch
#189308. :class:`SafeFileSystemReader` unpickles only DCP's metadata classes and :class:`SafeLoadPlanner`
loads bytes with ``weights_only=True``; anything else fails the resume.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from planner.core import StratagemError, atomic_write_text
from planner.plan import Plan
from runtime.executor.checkpoint_dirs import (
    COMPLETE_MARKER,
    META_FILE,
    find_latest_checkpoint,
    read_checkpoint_meta,
    step_dir,
    torn_checkpoints,
)
from runtime.executor.etp_keys import (
    etp_sliced_fqns,
    join_slices,
    model_key,
    optim_key,
    slice_rule,
    split_key,
    take_slice,
)

log = logging.getLogger(__name__)
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


# what DCP 2.13 pickles into .metadata for our state (model, flattened AdamW state, step, RNG)
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP metadata records and torch dtypes; any other global is refused."""

    def find_class(self, module: str, name: str):
        torch_value = getattr(torch, name, None) if module == "torch" else None
        if (module, name) in _METADATA_GLOBALS or isinstance(
            torch_value, (torch.dtype, torch.memory_format, torch.layout)
        ):
            return super().find_class(module, name)
        raise StratagemError(
            f"checkpoint metadata asks for {module}.{name}, which a DCP checkpoint never holds; "
            f"the checkpoint is corrupt or not from stratagem, use a fresh --checkpoint-dir"
        )


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is read with :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args, **kwargs) -> Metadata:  # noqa: ARG002 - FileSystemReader API
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as metadata_file:
            metadata = _MetadataUnpickler(metadata_file).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` loading non-tensor entries with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        value = torch.load(value, weights_only=True)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], value)
        else:
            self.state_dict[fqn] = value


def _state(chunks: list[nn.Module], optimizers: list[torch.optim.Optimizer], step: int, rank: int):
    """The state DCP saves or fills, this rank's per-chunk model and optimizer state dicts, and the renamed
    keys of etp-sliced parameters (FQN -> checkpoint key, :mod:`runtime.executor.etp_keys`)."""
    models = [get_model_state_dict(c, options=_OPTIONS) for c in chunks]
    optims = [get_optimizer_state_dict(c, o, options=_OPTIONS) for c, o in zip(chunks, optimizers)]
    sliced = {fqn: key for c, sd in zip(chunks, models) for fqn, key in etp_sliced_fqns(c, set(sd)).items()}
    state = {
        "model": {model_key(sliced, k): v for sd in models for k, v in sd.items()},
        "optim": {optim_key(sliced, k): v for sd in optims for k, v in sd.items()},
        "step": torch.tensor(step, dtype=torch.int64),
        f"rng.rank{rank}": torch.get_rng_state(),
    }
    return state, models, optims, sliced


def save_checkpoint(
    ckpt_dir: str | Path, step: int, chunks: list[nn.Module], optimizers: list[torch.optim.Optimizer], *, meta: dict
) -> Path:
    """Collective: every rank calls it after optimizer step ``step``. Returns the final folder.

    A failed write (a full disk, a lost mount) leaves earlier checkpoints as they were: the partial
    ``.tmp`` folder is removed and a :class:`StratagemError` names the newest checkpoint still complete.
    """
    rank = dist.get_rank()
    final = step_dir(ckpt_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
            tmp.mkdir(parents=True)
        dist.barrier()
        state, *_ = _state(chunks, optimizers, step, rank)
        dcp.save(state, checkpoint_id=str(tmp))  # collective: a write error on any rank raises on all
        _maybe_die_while_saving(step)
        dist.barrier()
        if rank == 0:
            atomic_write_text(tmp / META_FILE, json.dumps({"step": step, **meta}, indent=1) + "\n")
            atomic_write_text(tmp / COMPLETE_MARKER, f"step {step}\n")
            shutil.rmtree(final, ignore_errors=True)  # an incomplete folder of the same step
            os.replace(tmp, final)
            log.info("checkpoint %s written", final)
    except (OSError, StratagemError, dcp.api.CheckpointException) as exc:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = find_latest_checkpoint(ckpt_dir)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0][:200]
        raise StratagemError(
            f"checkpoint of step {step} could not be written ({reason}); "
            + (f"{previous} is intact: " if previous else "no earlier checkpoint: ")
            + "free space in --checkpoint-dir, then continue with --resume"
        ) from None
    dist.barrier()
    return final


def load_checkpoint(
    path: str | Path,
    chunks: list[nn.Module],
    optimizers: list[torch.optim.Optimizer],
    *,
    aliases: dict[str, str] | None = None,
) -> int:
    """Collective: restore model, optimizer and RNG state in place; returns the step it was saved at.

    Any layout may load a checkpoint any layout wrote (resharding): entries are keyed by full-model FQN, experts
    by global index, and DCP reads each rank's own shard of every tensor (DTensor offsets under tp and ZeRO,
    whole tensors under dp, a stage's FQNs under pp). An expert FFN slice written under another etp is put
    together from the checkpoint's slices and cut again (:func:`_reslice`). ``aliases`` (FQN -> FQN): where a
    parameter's entries are missing, those of the parameter it is tied to (a tied LM head, which shares the
    embedding's Parameter and AdamW state when pp = 1 and is its own copy, updated alike, when pp > 1). A rank the
    writing layout did not have keeps its seeded RNG state."""
    rank = dist.get_rank()
    state, models, optims, sliced = _state(chunks, optimizers, 0, rank)
    reader = SafeFileSystemReader(str(path))
    # DCP would wrap a refusal in CheckpointException; fail with the one-line error here
    have = reader.read_metadata().state_dict_metadata
    rng = f"rng.rank{rank}"
    if rng not in have:
        del state[rng]
    sources = _reslice_sources(state, have, path, aliases or {})
    targets = {(part, key): state[part].pop(key) for part, key in sources}
    for (part, _), keys in sources.items():
        for key in keys:
            item = have[key]
            state[part][key[len(part) + 1 :]] = (
                torch.empty(item.size, dtype=item.properties.dtype) if isinstance(item, TensorStorageMetadata) else None
            )
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())  # fills the tensors of `state` in place
    for (part, key), keys in sources.items():
        parts = [state[part].pop(k[len(part) + 1 :]) for k in keys]
        state[part][key] = _reslice(f"{part}.{key}", targets[(part, key)], parts)
    for chunk, opt, msd, osd in zip(chunks, optimizers, models, optims):
        osd.update({k: state["optim"][optim_key(sliced, k)] for k in osd})  # non-tensor entries were replaced
        set_model_state_dict(chunk, msd, options=_OPTIONS)
        set_optimizer_state_dict(chunk, opt, osd, options=_OPTIONS)
    if rng in state:
        torch.set_rng_state(state[rng])
    return int(state["step"])


def _reslice_sources(
    state: dict, have: dict, path: str | Path, aliases: dict[str, str]
) -> dict[tuple[str, str], list[str]]:
    """``(part, key) -> checkpoint keys`` for every model/optimizer entry of ``state`` that the checkpoint holds
    only under another etp (the whole entry, written with etp 1, or all its slices in order) or only under the
    FQN its parameter is tied to (``aliases``). An entry the checkpoint does not hold in any form raises."""
    slices: dict[str, dict[int, str]] = {}
    for key in have:
        whole, index, etp = split_key(key)
        if etp > 1:
            slices.setdefault(whole, {})[index] = key
    out, missing, wanted = {}, [], 0
    for part in ("model", "optim"):
        for key in state[part]:
            wanted += 1
            full = f"{part}.{key}"
            if full in have:
                continue
            whole = split_key(full)[0]
            written = slices.get(whole, {})
            tied = next((full.replace(a, b, 1) for a, b in aliases.items() if f".{a}." in f"{full}."), None)
            if tied is not None and tied in have:
                out[(part, key)] = [tied]
            elif whole in have:
                out[(part, key)] = [whole]
            elif written and sorted(written) == list(range(split_key(next(iter(written.values())))[2])):
                out[(part, key)] = [written[i] for i in sorted(written)]
            else:
                missing.append(full)
    if missing:
        raise StratagemError(
            f"checkpoint {path} has no {missing[0]} ({len(missing)} of this rank's {wanted} entries missing): "
            f"it was written for another model; use that run's plan or a fresh --checkpoint-dir"
        )
    return out


def _reslice(key: str, target, parts: list):
    """Entry ``key`` (this layout's etp slice, or the whole) from ``parts`` (the checkpoint's slices, or the
    whole), written into ``target`` (a plain tensor, or this rank's DTensor shard under ZeRO). Scalars (AdamW's
    step) and hyper-parameters are the same in every slice."""
    if not isinstance(target, torch.Tensor):
        return parts[0]
    if target.dim() == 0:
        target.copy_(parts[0])
        return target
    _, index, etp = split_key(key)
    if len(parts) == 1 and etp == 1:  # a tied parameter's entry, or an etp 1 layout's whole expert weight
        mine = parts[0]
    else:
        rule = slice_rule(key)
        whole = join_slices(parts, rule) if len(parts) > 1 else parts[0]
        mine = take_slice(whole, rule, index, etp) if etp > 1 else whole
    if isinstance(target, DTensor):
        mine = distribute_tensor(mine, target.device_mesh, target.placements, src_data_rank=None).to_local()
        target.to_local().copy_(mine)
    else:
        target.copy_(mine)
    return target


def read_full_checkpoint(path: str | Path) -> dict[str, object]:
    """Every entry of the checkpoint at ``path`` as one process sees it, free of the layout that wrote it: each
    tensor whole (its shards put together by DCP from their offsets), an expert FFN's etp slices joined under the
    parameter's own key, each non-tensor entry (AdamW's hyper-parameters) as saved. No process group is needed:
    a single process reads a checkpoint any layout wrote (checks, conversions)."""
    reader = SafeFileSystemReader(str(path))
    meta = reader.read_metadata()
    state: dict[str, object] = {
        key: torch.empty(item.size, dtype=item.properties.dtype) if isinstance(item, TensorStorageMetadata) else None
        for key, item in meta.state_dict_metadata.items()
    }
    with warnings.catch_warnings():  # DCP warns that no process group is initialised: that is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    slices: dict[str, dict[int, object]] = {}
    for key in [k for k in state if split_key(k)[2] > 1]:
        whole, index, _ = split_key(key)
        slices.setdefault(whole, {})[index] = state.pop(key)
    for whole, parts in slices.items():
        ordered = [parts[i] for i in sorted(parts)]
        first = ordered[0]
        joined = isinstance(first, torch.Tensor) and first.dim() > 0
        state[whole] = join_slices(ordered, slice_rule(whole)) if joined else first  # type: ignore[arg-type]
    return state


def checkpoint_meta(plan: Plan, world_size: int) -> dict:
    """What ``meta.json`` records beside the step: the model and training settings a resume must share (any
    layout may resume it), and the layout that wrote it (mesh, plan hash, expert layout)."""
    lay = plan.experts
    return {
        "model": plan.model.name,
        "model_digest": model_digest(plan),
        "model_dims": dict(plan.model.dims),
        "training": plan.training.model_dump(mode="json"),
        "world_size": world_size,
        "mesh": dict(zip(plan.mesh.axes, plan.mesh.sizes)),
        "plan_hash": plan.content_hash,
        **expert_meta(lay.ep if lay else 1, lay.etp if lay else 1),
    }


def model_digest(plan: Plan) -> str:
    """sha256 of what builds the model (family, dims, source, config): equal digests, equal parameters."""
    spec = plan.model.model_dump(mode="json", include={"family", "dims", "source", "config"})
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def check_resumable(ckpt_dir: str | Path, plan: Plan, *, batch_may_change: bool = False) -> Path:
    """Launcher-side check for ``--resume``: a complete checkpoint exists, of this model and training settings
    (:func:`check_compatible`, ``batch_may_change`` passed on), with metadata that is DCP's. Returns its folder."""
    latest = find_latest_checkpoint(ckpt_dir)
    if latest is None:
        raise StratagemError(
            f"--resume given but {ckpt_dir} holds no complete checkpoint (step_*/COMPLETE); "
            f"drop --resume or point --checkpoint-dir at an earlier run"
        )
    for torn in torn_checkpoints(ckpt_dir):
        log.warning("%s is incomplete (its save was interrupted): resuming from %s", torn, latest)
    check_compatible(latest, read_checkpoint_meta(latest), plan, batch_may_change=batch_may_change)
    try:
        SafeFileSystemReader(str(latest)).read_metadata()  # refuses metadata that is not DCP's, before any rank starts
    except OSError as exc:
        raise StratagemError(
            f"checkpoint {latest} is damaged ({exc.strerror or exc}: its DCP .metadata cannot be read); "
            f"move that folder aside to resume from an earlier one"
        ) from None
    return latest


def check_compatible(path: str | Path, meta: dict, plan: Plan, *, batch_may_change: bool = False) -> None:
    """Refuse, in one line, a checkpoint of another model or other training settings. Its layout (tp, pp, dp,
    cp, ep, etp, ZeRO stage, stage boundaries, world size) may differ: the load reshards. A checkpoint written
    before ``meta.json`` recorded the training settings resumes only under its own world size and expert layout.
    ``batch_may_change`` (``launch --elastic``, whose plan for a world may take the nearest global batch the
    recipe allows when no plan of the run's batch fits it): the global batch may differ too."""
    if meta.get("model") != plan.model.name:
        raise StratagemError(
            f"checkpoint {path} was written for model {meta.get('model')} but the plan "
            f"trains {plan.model.name}; use that run's plan or a fresh --checkpoint-dir"
        )
    lay = plan.experts
    experts = (lay.ep, lay.etp) if lay else (1, 1)
    if "training" not in meta:
        if meta.get("world_size") != plan.world_size:
            raise StratagemError(
                f"checkpoint {path} predates resharding (no training settings in {META_FILE}) and was written by "
                f"{meta.get('world_size')} ranks but the plan has {plan.world_size}; resume with the plan that wrote it"
            )
        check_expert_layout(path, meta, experts=experts)
        return
    if meta.get("model_digest") not in (None, model_digest(plan)):
        dims = meta.get("model_dims")
        written: dict = dims if isinstance(dims, dict) else {}
        mine = dict(plan.model.dims)
        diff = sorted(k for k in set(written) | set(mine) if written.get(k) != mine.get(k))
        what = ", ".join(f"{k} {written.get(k)} -> {mine.get(k)}" for k in diff[:4]) or "its config or source"
        raise StratagemError(
            f"checkpoint {path} was written for another {plan.model.name} ({what}); "
            f"use that run's plan or a fresh --checkpoint-dir"
        )
    theirs, mine = meta["training"], plan.training.model_dump(mode="json")
    if not isinstance(theirs, dict):
        raise StratagemError(f"checkpoint {path} has a malformed 'training' entry in {META_FILE}")
    diff = sorted(k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k))
    if batch_may_change:
        diff = [k for k in diff if k != "global_batch"]
    if diff:
        what = ", ".join(f"{k} {theirs.get(k)} -> {mine.get(k)}" for k in diff[:4])
        raise StratagemError(
            f"checkpoint {path} was written with other training settings ({what}); a resume continues the same "
            f"training: re-plan with the checkpoint's settings or use a fresh --checkpoint-dir"
        )
    written = meta.get("experts", {})
    if (
        plan.model.family == "hf"
        and isinstance(written, dict)
        and (written.get("ep", 1), written.get("etp", 1)) != experts
    ):
        if 1 in (written.get("ep", 1) * written.get("etp", 1), experts[0] * experts[1]):
            raise StratagemError(
                f"checkpoint {path} holds an hf: model's experts "
                + ("fused (ep 1, etp 1)" if experts != (1, 1) else "per expert (an expert layout)")
                + " but the plan "
                + ("lays them out per expert" if experts != (1, 1) else "keeps them fused")
                + "; resume with an expert layout like the one that wrote it, or a fresh --checkpoint-dir"
            )
    check_expert_layout(path, meta, experts=experts, reshard=True)


def expert_meta(ep: int, etp: int) -> dict:
    """The ``experts`` entry of ``meta.json``: the layout the expert parameters' keys and slices follow."""
    return {"experts": {"ep": ep, "etp": etp}}


def check_expert_layout(path: str | Path, meta: dict, *, experts: tuple[int, int], reshard: bool = False) -> None:
    """Refuse a malformed ``experts`` entry, and a resume whose (ep, etp) differs from a checkpoint written
    before resharding (``reshard`` False: its meta.json has no training settings), whose etp slices were loaded
    by key only. A checkpoint without the entry predates it and was written with etp 1 (etp > 1 was refused
    then), its ep not recorded."""
    written = meta.get("experts", {"etp": 1})
    if not isinstance(written, dict) or not all(isinstance(v, int) for v in written.values()):
        raise StratagemError(
            f"checkpoint {path} has a malformed 'experts' entry in {META_FILE}; use a checkpoint Stratagem wrote"
        )
    wanted = dict(zip(("ep", "etp"), experts))
    if reshard:  # experts keep their global names and etp slices are cut again on load (load_checkpoint)
        wanted = {}
    if any(k in written and written[k] != v for k, v in wanted.items()):
        was = " ".join(f"{k}={v}" for k, v in written.items())
        raise StratagemError(
            f"checkpoint {path} was written with experts {was} but the plan has ep={experts[0]} etp={experts[1]}; "
            f"resume with the plan that wrote it or use a fresh --checkpoint-dir"
        )


def _maybe_die_while_saving(step: int) -> None:
    """Test hook: ``STRATAGEM_TEST_DIE_IN_SAVE=<step>`` kills rank 1 after its shards, before the commit."""
    if (
        os.environ.get("STRATAGEM_TEST_DIE_IN_SAVE") == str(step)
        and dist.get_rank() == 1
        and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    ):
        os._exit(17)
