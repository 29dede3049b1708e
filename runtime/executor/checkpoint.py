"""Distributed checkpoints (torch.distributed.checkpoint) that are either complete or ignored.

Layout: ``DIR/step_000004/`` holds the DCP shards, ``meta.json`` (step, model, mesh) and a ``COMPLETE``
marker. A save goes to ``DIR/step_000004.tmp/``; only after every rank has written its shards does rank
0 write ``meta.json`` and ``COMPLETE`` into it and rename it to ``DIR/step_000004`` (``os.replace``, atomic
on POSIX). A save killed half-way therefore leaves a ``.tmp`` folder (or, at worst, a folder without the
marker), which :func:`find_latest_checkpoint` never picks.

What is saved: model and AdamW state of every pipeline chunk this rank holds (keys are full-model FQNs,
so chunks merge into one dict; ``flatten_optimizer_state_dict`` keys optimizer state by FQN too), the
step (= data position, see ``data``), and each rank's RNG state. DCP takes same-named tensors on several ranks
for copies of one tensor (or shards of it, by offset), which holds for every parameter but the FFN slices of an
expert under expert tensor parallelism (etp > 1): its etp peers hold different slices under one name. Those are
stored under keys naming the slice (``<fqn>.etp<i>_of_<etp>``, the optimizer's flattened keys likewise) and
mapped back when loading (:mod:`runtime.executor.etp_keys`); the ranks sharing such a key are the slice's edp
copies or shards, as for any other parameter. ``meta.json`` records ep and etp, and a resume with another
layout is refused (:func:`check_expert_layout`): the slices' keys and widths follow it.

Loading is restricted (the checkpoint folder is user input): torch 2.13's ``FileSystemReader`` reads DCP's
``.metadata`` with a plain ``pickle.load`` and ``DefaultLoadPlanner.load_bytes`` uses
``torch.load(weights_only=False)`` for non-tensor entries (AdamW's param_groups), see pytorch/pytorch
#189308. :class:`SafeFileSystemReader` unpickles only DCP's metadata classes and :class:`SafeLoadPlanner`
loads bytes with ``weights_only=True``; anything else fails the resume.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from planner.core import StratagemError, atomic_write_text, read_json
from runtime.executor.etp_keys import etp_sliced_fqns, model_key, optim_key

log = logging.getLogger(__name__)
COMPLETE_MARKER = "COMPLETE"
META_FILE = "meta.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
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


def step_dir(ckpt_dir: str | Path, step: int) -> Path:
    return Path(ckpt_dir) / f"step_{step:06d}"


def find_latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder under ``ckpt_dir`` (``None`` if there is none).

    Complete = named ``step_<digits>`` (not ``.tmp``) and holding the ``COMPLETE`` marker.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return None
    done = [
        (int(m.group(1)), p)
        for p in ckpt_dir.iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / COMPLETE_MARKER).is_file()
    ]
    return max(done)[1] if done else None


def read_checkpoint_meta(path: str | Path) -> dict:
    return read_json(Path(path) / META_FILE, what="checkpoint metadata")


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


def load_checkpoint(path: str | Path, chunks: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> int:
    """Collective: restore model, optimizer and RNG state in place; returns the step it was saved at."""
    rank = dist.get_rank()
    state, models, optims, sliced = _state(chunks, optimizers, 0, rank)
    reader = SafeFileSystemReader(str(path))
    reader.read_metadata()  # DCP would wrap a refusal in CheckpointException; fail with the one-line error here
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())  # fills the tensors of `state` in place
    for chunk, opt, msd, osd in zip(chunks, optimizers, models, optims):
        osd.update({k: state["optim"][optim_key(sliced, k)] for k in osd})  # non-tensor entries were replaced
        set_model_state_dict(chunk, msd, options=_OPTIONS)
        set_optimizer_state_dict(chunk, opt, osd, options=_OPTIONS)
    torch.set_rng_state(state[f"rng.rank{rank}"])
    return int(state["step"])


def check_resumable(
    ckpt_dir: str | Path, *, model_name: str, world_size: int, experts: tuple[int, int] = (1, 1)
) -> Path:
    """Launcher-side check for ``--resume``: a complete checkpoint exists and was written by this model, world
    size and expert layout ``experts`` = (ep, etp)."""
    latest = find_latest_checkpoint(ckpt_dir)
    if latest is None:
        raise StratagemError(
            f"--resume given but {ckpt_dir} holds no complete checkpoint (step_*/COMPLETE); "
            f"drop --resume or point --checkpoint-dir at an earlier run"
        )
    meta = read_checkpoint_meta(latest)
    if meta.get("model") != model_name:
        raise StratagemError(
            f"checkpoint {latest} was written for model {meta.get('model')} but the plan "
            f"trains {model_name}; use that run's plan or a fresh --checkpoint-dir"
        )
    if meta.get("world_size") != world_size:
        raise StratagemError(
            f"checkpoint {latest} was written by {meta.get('world_size')} ranks but the plan "
            f"has {world_size}; resume with the plan that wrote it"
        )
    check_expert_layout(latest, meta, experts=experts)
    SafeFileSystemReader(str(latest)).read_metadata()  # refuses metadata that is not DCP's, before any rank starts
    return latest


def expert_meta(ep: int, etp: int) -> dict:
    """The ``experts`` entry of ``meta.json``: the layout the expert parameters' keys and slices follow."""
    return {"experts": {"ep": ep, "etp": etp}}


def check_expert_layout(path: str | Path, meta: dict, *, experts: tuple[int, int]) -> None:
    """Refuse a resume whose (ep, etp) differs from the checkpoint's: each etp slice is its own key and the
    slice widths follow etp, so another layout would miss keys or load wrong slices. A checkpoint without the
    entry predates it and was written with etp 1 (etp > 1 was refused then), its ep not recorded."""
    written = meta.get("experts", {"etp": 1})
    if not isinstance(written, dict) or not all(isinstance(v, int) for v in written.values()):
        raise StratagemError(
            f"checkpoint {path} has a malformed 'experts' entry in {META_FILE}; use a checkpoint Stratagem wrote"
        )
    wanted = dict(zip(("ep", "etp"), experts))
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
