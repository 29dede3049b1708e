"""Training data: the global batch of each step, and each dp replica's share of it.

Every rank builds the same global batch for step ``s`` (synthetic data is drawn from a generator seeded
with ``(seed, s)``; file data is read at position ``s * global_batch``), then keeps the rows of its dp
replica. So each sample of the global batch is used exactly once per step, a resumed job sees the same
data as an uninterrupted one (the data position is the step), and a single-process run of the full
batch is the reference for every parallel layout. The one exception: an elastic job whose plan for the devices
left took another global batch reads the run's sample stream on from the next sample (:class:`DataStream`).

Uneven ``batch_shares`` (mixed clusters): replica ``r`` gets ``n_r = share_r * B`` rows and runs
``m_r = n_r / micro_batch_size`` micro-batches of the plan's one ``schedule.micro_batch_size`` — the same
size, different counts, as the cost model has it (planner/cost/validate.py ``replica_micro_batches``); a
fast replica runs more micro-batches, not bigger ones. Without shares every replica runs the same ``m``
micro-batches of ``B / (dp * m)`` rows. The split is derived once, by ``planner.plan.schema.make_schedule``, and every
plan file carries its counts (``schedule.micro_batches_per_replica``), which ``planner.plan.schema.split_batch`` reads.

Gradients stay those of the full-batch mean loss: each replica's schedule averages its ``m_r`` equal-size
micro-batch losses (``scale_grads``, or ``1/m_r`` in ``LocalRunner``), which is its mean loss; dp gradient
reduction averages over the ``dp`` replicas, so replica ``r`` scales its loss by ``dp * n_r / B``
(``loss_scale``), and the average of the scaled gradients is ``sum_r (n_r / B) * grad(mean loss_r)``,
the gradient of the full-batch mean loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from planner.core import StratagemError
from planner.model import ModelSpec
from planner.plan import BatchSplit, Plan, micro_batches_per_replica, rows_per_replica, split_batch  # noqa: F401


@dataclass(frozen=True, kw_only=True, slots=True)
class Batch:
    inputs: torch.Tensor
    targets: torch.Tensor

    def rows(self, start: int, stop: int) -> "Batch":
        return Batch(inputs=self.inputs[start:stop], targets=self.targets[start:stop])

    def to(self, device: torch.device) -> "Batch":
        return Batch(inputs=self.inputs.to(device), targets=self.targets.to(device))


def replica_rows(rows: Sequence[int], dp_index: int) -> tuple[int, int]:
    """``(start, stop)`` of replica ``dp_index``'s rows in the global batch."""
    start = sum(rows[:dp_index])
    return start, start + rows[dp_index]


def loss_scale(rows: Sequence[int], dp_index: int) -> float:
    """Factor on replica ``dp_index``'s mean loss so that dp averaging gives the full-batch mean (1.0 if even)."""
    return len(rows) * rows[dp_index] / sum(rows)


def synthetic_batch(spec: ModelSpec, *, batch: int, seq_len: int, seed: int, step: int) -> Batch:
    """Step ``step``'s global batch of random data shaped for ``spec``'s family (CPU tensors).

    GPT/Llama: token ids ``(batch, seq_len)`` and next-token targets; ResNet: images
    ``(batch, in_channels, image_size, image_size)`` and class labels; MLP: features and class labels.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    if spec.family == "custom":  # the model's declared input_spec (runtime.models.custom)
        from runtime.models import example_batch

        inputs, targets = example_batch(spec, batch, seq_len, seed=seed * 1_000_003 + step)
        return Batch(inputs=inputs, targets=targets)
    if spec.is_language_model:
        tokens = torch.randint(0, int(spec.dim("vocab")), (batch, seq_len + 1), generator=gen)
        return Batch(inputs=tokens[:, :-1].contiguous(), targets=tokens[:, 1:].contiguous())
    if spec.family == "resnet":
        size, chans = int(spec.dim("image_size")), int(spec.dim("in_channels"))
        images = torch.randn(batch, chans, size, size, generator=gen)
        return Batch(inputs=images, targets=torch.randint(0, int(spec.dim("num_classes")), (batch,), generator=gen))
    if spec.family in ("unet3d", "cosmoflow"):  # volumes (batch, C, V, V, V); voxel labels or 4 parameters
        from runtime.models.cnn3d import volume_targets
        from runtime.models.dims import resolve_dims

        side, chans = int(spec.dim("volume")), int(spec.dim("in_channels"))
        volumes = torch.randn(batch, chans, side, side, side, generator=gen)
        return Batch(inputs=volumes, targets=volume_targets(resolve_dims(spec), volumes, gen))  # type: ignore[arg-type]
    if spec.family == "mlp":
        feats = torch.randn(batch, int(spec.dim("in_features")), generator=gen)
        return Batch(inputs=feats, targets=torch.randint(0, int(spec.dim("out_features")), (batch,), generator=gen))
    raise StratagemError(f"no synthetic data for model family {spec.family!r}; pass --data FILE")


class FileData:
    """Samples from a tensor file ``{"inputs": (N, ...), "targets": (N, ...)}`` (``torch.save`` of a dict).

    Loaded with ``weights_only=True``. Batch ``i`` (0-based) takes rows ``i*B .. i*B+B-1`` modulo ``N``
    (epochs wrap); training step ``s`` (1-based) reads batch ``s - 1``.
    """

    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.exists():
            raise StratagemError(f"data file {path} does not exist; pass --data synthetic or a valid path")
        if not path.is_file():
            raise StratagemError(f"data file {path} is not a regular file; pass --data synthetic or a tensor file")
        try:
            data = torch.load(path, weights_only=True, map_location="cpu")
        except Exception as exc:  # noqa: BLE001 - torch raises several types for a bad file
            raise StratagemError(
                f"cannot read data file {path} ({type(exc).__name__}); write it with "
                f"torch.save({{'inputs': X, 'targets': Y}}, path)"
            ) from None
        if not (isinstance(data, dict) and {"inputs", "targets"} <= set(data)):
            raise StratagemError(f"data file {path} must hold a dict with 'inputs' and 'targets' tensors")
        self.inputs, self.targets = data["inputs"], data["targets"]
        if len(self.inputs) != len(self.targets) or len(self.inputs) == 0:
            raise StratagemError(f"data file {path} has {len(self.inputs)} inputs but {len(self.targets)} targets")

    def check_shapes(self, spec: ModelSpec, seq_len: int) -> None:
        """Samples must have the shape the model takes (``sample_shape``), e.g. ``[seq_len]`` token ids."""
        from runtime.models import sample_shape

        expected = sample_shape(spec, seq_len)
        if list(self.inputs.shape[1:]) != expected:
            raise StratagemError(
                f"data file samples have shape {list(self.inputs.shape[1:])} but {spec.name} at "
                f"seq_len {seq_len} takes {expected}; regenerate the file or re-plan"
            )

    def batch(self, *, batch: int, index: int) -> Batch:
        idx = (torch.arange(batch) + index * batch) % len(self.inputs)
        return Batch(inputs=self.inputs[idx], targets=self.targets[idx])


def build_data_source(
    spec: ModelSpec,
    data: str,
    *,
    global_batch: int,
    seq_len: int,
    seed: int,
    stream: DataStream | None = None,
):
    """A function ``step -> Batch`` (the global batch) for ``--data synthetic`` or ``--data FILE``.

    ``stream``: where the steps read the run's sample stream when the global batch changed during the run
    (``launch --elastic`` on a world no plan of the first batch fits). The stream is the run's first batches in
    order (its sample ``i`` is row ``i % stream.batch`` of step ``i // stream.batch + 1`` at that batch), and
    step ``s`` reads its ``global_batch`` samples from ``stream.first_sample + (s - stream.first_step) *
    global_batch`` on, so a changed batch continues from the sample after the last one trained. Without it (or
    aligned with it) step ``s`` reads step ``s``'s batch, as always."""
    source = None if data == "synthetic" else FileData(data)

    def at(step: int, batch: int) -> Batch:
        if source is None:
            return synthetic_batch(spec, batch=batch, seq_len=seq_len, seed=seed, step=step)
        return source.batch(batch=batch, index=step - 1)

    if stream is None or stream.aligned(global_batch):
        return lambda step: at(step, global_batch)

    def read(step: int) -> Batch:
        lo = stream.first_sample + (step - stream.first_step) * global_batch
        pieces, i = [], lo
        while i < lo + global_batch:
            row = i % stream.batch
            take = min(stream.batch - row, lo + global_batch - i)
            pieces.append(at(i // stream.batch + 1, stream.batch).rows(row, row + take))
            i += take
        return Batch(inputs=torch.cat([p.inputs for p in pieces]), targets=torch.cat([p.targets for p in pieces]))

    return read


@dataclass(frozen=True, slots=True)
class DataStream:
    """A run's sample stream seen from a resumed step: ``batch`` (the run's first global batch, which numbers
    the stream's samples), ``first_step`` (the step resumed at) and ``first_sample`` (the samples trained before
    it)."""

    batch: int
    first_step: int
    first_sample: int

    def aligned(self, global_batch: int) -> bool:
        """True when step ``s`` at ``global_batch`` reads exactly step ``s``'s batch of the stream."""
        return global_batch == self.batch and self.first_sample == (self.first_step - 1) * self.batch
