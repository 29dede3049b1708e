"""Per-step metrics as JSON lines (rank 0), with the plan's predictions beside the measurements.

Lines: ``{"event": "start", ...}``, one ``{"event": "step", ...}`` per optimizer step (``peak_memory_bytes``
and ``peak_rss_bytes`` are lists, one value per rank; MoE models add ``moe_aux_loss``, the load-balancing
loss of ``runtime.models.moe`` averaged over layers, micro-batches and ranks: 1.0 is perfectly balanced),
and a final ``{"event": "summary", "summary": true, ...}`` comparing
predicted and measured step time and peak memory — the format ``planner.inspect.measured`` reads. A
restarted job appends (``attempt`` tells the runs apart); a reader takes the last line of each step.
Peak memory per rank: on CUDA ``torch.cuda.max_memory_allocated`` (reset when a plan starts), with
``peak_reserved_bytes`` beside it (``max_memory_reserved``: the caching allocator's blocks); on CPU the
growth of the resident set over its size when the plan started: the peak (``VmHWM`` in /proc/self/status,
reset by writing 5 to /proc/self/clear_refs, proc(5)) minus the ``VmRSS`` before the model was built. So
it counts what training added (weights, gradients, optimizer state, activations, communication
buffers, allocator slack) and not the ~300 MiB of Python/torch runtime. Without /proc it falls back to
``getrusage`` ``ru_maxrss`` (the whole process, never reset). ``peak_rss_bytes`` is the whole process's
peak resident set (runtime included) on either device.

Peak tensor memory per rank, on every device: the first step of each launch (the warm-up that step-time figures
leave out) runs under ``runtime.executor.tensor_memory.TensorMemory``, which counts the bytes of live tensor
storages; its step record adds ``peak_tensor_bytes`` (one value per rank) and ``tensor_bytes_by_kind`` (per rank:
params, grads, optimizer, activations, temporaries at that rank's peak), with the optimizer state the step created
counted in, as every later step holds it. The summary compares it with the plan's prediction of the same quantity,
each rank's predicted peak without the ``reserve`` term (allocator fragmentation and the CUDA context, which are
not tensors): ``predicted_peak_tensor_bytes`` and ``tensor_memory_error`` (the largest |measured / predicted - 1|
over ranks).
"""

from __future__ import annotations

import json
import time
import resource
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from planner.plan import Plan, predicted_tensor_bytes

if TYPE_CHECKING:  # the CLI reads metrics files after a launch: it should not pay torch's import for that
    import torch

KIB = 1024  # ru_maxrss unit on Linux (getrusage(2))


def _proc_status_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * KIB  # "VmHWM:   123456 kB"
    except OSError:
        return None
    return None


def reset_peak_memory(device: torch.device) -> int:
    """Start a new peak-memory window; returns the baseline that :func:`peak_memory_bytes` subtracts."""
    if device.type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)
        return 0
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return 0
    return _proc_status_bytes("VmRSS") or 0


def peak_rss_bytes() -> int:
    """The process's peak resident set since the last reset (whole process, runtime included)."""
    hwm = _proc_status_bytes("VmHWM")
    return hwm if hwm is not None else int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * KIB


def peak_reserved_bytes(device: torch.device) -> int | None:
    """On CUDA the caching allocator's peak of reserved bytes since :func:`reset_peak_memory`
    (``torch.cuda.max_memory_reserved``: what ``max_memory_allocated`` counts plus the blocks it keeps cached and
    the rounding); None on other devices, which have no such allocator."""
    if device.type != "cuda":
        return None
    import torch

    return int(torch.cuda.max_memory_reserved(device))


def peak_memory_bytes(device: torch.device, baseline_bytes: int = 0) -> int:
    """Peak bytes this rank used since :func:`reset_peak_memory` returned ``baseline_bytes``."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    hwm = _proc_status_bytes("VmHWM") if baseline_bytes else None
    if hwm is None:
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * KIB
    return max(0, hwm - baseline_bytes)


class MetricsLog:
    """Appends JSON lines to ``path`` (no-op when ``path`` is None, i.e. on ranks other than 0)."""

    def __init__(self, path: str | Path | None, plan: Plan, *, attempt: int) -> None:
        self.path = Path(path) if path else None
        self.attempt = attempt
        pred = plan.predictions
        self.pred_time_s = pred.step_time_s if pred else None
        self.pred_mem_bytes = pred.peak_memory_bytes if pred else None
        self.step_times_s: list[float] = []
        self.peak_bytes: list[int] = []
        self.tensor_peaks: list[int] | None = None
        self.pred_tensor_bytes = predicted_tensor_bytes(plan)
        self.last_loss: float | None = None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        if self.path is None:
            return
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps({**record, "attempt": self.attempt, "unix_time": time.time()}, allow_nan=False) + "\n")
            fh.flush()

    def step(
        self,
        *,
        step: int,
        loss: float,
        step_time_s: float,
        tokens: int,
        samples: int,
        peak_memory_bytes: list[int],
        peak_rss_bytes: list[int] | None = None,
        lr: float | None = None,
        moe_aux_loss: float | None = None,
        tensor_peaks: list | None = None,
        peak_reserved_bytes: list[int] | None = None,
    ) -> None:
        self.step_times_s.append(step_time_s)
        self.peak_bytes.append(max(peak_memory_bytes))
        self.last_loss = loss
        extra: dict[str, object] = {} if moe_aux_loss is None else {"moe_aux_loss": moe_aux_loss}  # MoE models only
        if peak_reserved_bytes is not None:  # CUDA only
            extra["peak_reserved_bytes"] = peak_reserved_bytes
        if tensor_peaks:  # the step measured under TensorMemory
            self.tensor_peaks = [p.peak_bytes for p in tensor_peaks]
            extra["peak_tensor_bytes"] = self.tensor_peaks
            extra["tensor_bytes_by_kind"] = [p.by_kind for p in tensor_peaks]
        self.write(
            {
                "event": "step",
                "step": step,
                "loss": loss,
                "lr": lr,
                "step_time_s": step_time_s,
                "tokens_per_s": tokens / step_time_s,
                "samples_per_s": samples / step_time_s,
                "peak_memory_bytes": peak_memory_bytes,
                "peak_rss_bytes": peak_rss_bytes,
                "predicted_step_time_s": self.pred_time_s,
                "predicted_peak_memory_bytes": self.pred_mem_bytes,
                **extra,
            }
        )

    def summary(self) -> dict:
        """Median step time (first step excluded as warm-up when there are more) vs the prediction."""
        times = self.step_times_s[1:] or self.step_times_s
        measured_s = statistics.median(times) if times else None
        peak = max(self.peak_bytes) if self.peak_bytes else None
        record = {
            "event": "summary",
            "summary": True,
            "steps": len(self.step_times_s),
            "final_loss": self.last_loss,
            "measured_step_time_s": measured_s,
            "predicted_step_time_s": self.pred_time_s,
            "step_time_ratio": measured_s / self.pred_time_s if measured_s and self.pred_time_s else None,
            "measured_peak_memory_bytes": peak,
            "predicted_peak_memory_bytes": self.pred_mem_bytes,
            "memory_ratio": peak / self.pred_mem_bytes if peak and self.pred_mem_bytes else None,
            "measured_peak_tensor_bytes": self.tensor_peaks,
            "predicted_peak_tensor_bytes": self.pred_tensor_bytes,
            "tensor_memory_error": tensor_memory_error(self.tensor_peaks, self.pred_tensor_bytes),
        }
        self.write(record)
        return record


def tensor_memory_error(measured: list[int] | None, predicted: list[float] | None) -> float | None:
    """The largest |measured / predicted - 1| over ranks.

    >>> tensor_memory_error([110, 95], [100.0, 100.0])
    0.1
    """
    if not measured or not predicted or len(measured) != len(predicted) or min(predicted) <= 0:
        return None
    return round(max(abs(m / p - 1.0) for m, p in zip(measured, predicted)), 12)


def read_metrics(path: str | Path) -> list[dict]:
    """All records of a metrics file, in order."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def final_step_losses(records: list[dict]) -> dict[int, float]:
    """step -> loss, the last record of each step winning (so a resumed run overrides the killed one)."""
    return {r["step"]: r["loss"] for r in records if r.get("event") == "step"}
