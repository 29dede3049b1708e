"""Checkpoint folders, without torch: ``DIR/step_000004/`` holds a save's DCP shards, its ``meta.json`` and, once
every rank has written, the ``COMPLETE`` marker (:mod:`runtime.executor.checkpoint` writes and reads them).
``stratagem launch --elastic`` looks for an earlier run's checkpoints here before any process starts, so the CLI does
not import torch for it.
"""

from __future__ import annotations

import re
from pathlib import Path

from planner.core import read_json

COMPLETE_MARKER = "COMPLETE"
META_FILE = "meta.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


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


def torn_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Folders under ``ckpt_dir`` of saves that never completed (``step_N.tmp``, or ``step_N`` without the
    marker) and are newer than the newest complete checkpoint: what a resume skips, oldest first."""
    ckpt_dir, latest = Path(ckpt_dir), find_latest_checkpoint(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    newest = int(_STEP_DIR.match(latest.name).group(1)) if latest else -1  # type: ignore[union-attr]
    torn = []
    for p in ckpt_dir.iterdir():
        m = _STEP_DIR.match(p.name.removesuffix(".tmp"))
        if m and int(m.group(1)) > newest and not (p / COMPLETE_MARKER).is_file():
            torn.append((int(m.group(1)), p))
    return [p for _, p in sorted(torn)]


def read_checkpoint_meta(path: str | Path) -> dict:
    return read_json(Path(path) / META_FILE, what="checkpoint metadata")
