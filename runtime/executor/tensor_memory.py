"""Peak live tensor bytes of one rank during a step, on any device, broken down like the memory prediction.

How it is measured: :class:`TensorMemory` is a ``TorchDispatchMode`` (the mechanism of torch's own
``torch.distributed._tools.mem_tracker``). It sees every operator's outputs, keeps a weak reference to each tensor
storage it has not seen before (the reference's callback tells it when the storage is freed) and sums the bytes of
the storages alive. The modules' parameters and buffers, their gradients and the optimizers' state that exist when
it starts are counted from the start. DTensors are counted through their local shards (the mode lets DTensor
desugar first). Each storage has a kind, as the prediction's terms (``planner.cost.memory.MemoryBreakdown``):
``params`` (parameters and buffers), ``grads`` (a parameter's ``.grad``, retagged when it is accumulated and before
each optimizer step), ``optimizer`` (allocated inside ``Optimizer.step``), ``activations`` (allocated outside the
autograd engine's backward) and ``temporaries`` (allocated inside it: activation gradients, recomputed
activations). :meth:`TensorMemory.peak` gives the high-water mark of the total and the bytes of each kind at it.

On CPU this is the only figure comparable with the prediction: the process's resident memory also holds the
interpreter, torch's libraries and the allocator's cache. On CUDA it runs beside ``max_memory_allocated``, which
also counts the caching allocator's 512-byte rounding and blocks allocated outside the dispatcher.

``UntypedStorage.resize_`` (how FSDP2 frees a resharded parameter's storage and re-allocates it) is not an
operator the mode sees: it is wrapped while the mode is active, as torch's ``MemTracker`` does.

What it cannot see: storages created outside the dispatcher (a collective library's own staging buffers, gloo's
or NCCL's) and operators' internal scratch space; bytes are the storages' sizes, not rounded to allocator blocks.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)
from torch.utils._pytree import tree_leaves

KINDS = ("params", "grads", "optimizer", "activations", "temporaries")


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorPeak:
    """One rank's peak of live tensor bytes in a window, and the bytes of each kind at that peak."""

    peak_bytes: int
    by_kind: dict[str, int]


def _storages(t: torch.Tensor, meta: bool = False) -> list[torch.UntypedStorage]:
    """The storages holding ``t``'s data (a wrapper subclass such as DTensor: its inner tensors'); meta tensors'
    only when ``meta`` (the profiler's measurements on the meta device)."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, name) for name in names]
        return [s for x in inner if isinstance(x, torch.Tensor) for s in _storages(x, meta)]
    if (t.device.type == "meta" and not meta) or type(t).__name__ == "FakeTensor":
        return []
    try:
        return [t.untyped_storage()]
    except (NotImplementedError, RuntimeError):  # a tensor without storage (sparse, nested)
        return []


class TensorMemory(TorchDispatchMode):
    """Tracks the live tensor storages of ``modules`` and ``optimizers`` and of everything the operators in a
    ``with`` block allocate; :meth:`peak` is the high-water mark since :meth:`reset`.

    >>> import torch
    >>> layer = torch.nn.Linear(4, 4)
    >>> opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    >>> with TensorMemory([layer], [opt]) as tracker:
    ...     layer(torch.ones(2, 4)).sum().backward()
    ...     opt.step()
    ...     tracker.reset()  # a new window starts with what is alive: weights and gradients, 4 x 4 + 4 fp32 each
    >>> tracker.peak()
    TensorPeak(peak_bytes=160, by_kind={'params': 80, 'grads': 80, 'optimizer': 0, 'activations': 0, 'temporaries': 0})
    """

    def __init__(
        self, modules: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer], *, meta: bool = False
    ) -> None:
        super().__init__()
        self._meta = meta
        self._live: dict[int, tuple[int, str, weakref.ref]] = {}  # storage id -> (bytes, kind, reference)
        self._now = dict.fromkeys(KINDS, 0)
        self._total = 0
        self._peak = TensorPeak(peak_bytes=0, by_kind=dict(self._now))
        self._in_optimizer = 0
        self._modules, self._optimizers = modules, optimizers
        self._hooks: list = []

    # --- bookkeeping -------------------------------------------------------------------------------------------
    def _add(self, t: torch.Tensor, kind: str, *, retag: bool = False) -> None:
        for st in _storages(t, self._meta):
            self._add_storage(st, kind, retag=retag)
        self._note_peak()

    def _add_storage(self, st: torch.UntypedStorage, kind: str, *, retag: bool = False) -> None:
        key = st._cdata
        seen = self._live.get(key)
        if seen is not None:
            if retag and seen[1] != kind:
                self._now[seen[1]] -= seen[0]
                self._now[kind] += seen[0]
                self._live[key] = (seen[0], kind, seen[2])
            return
        nbytes = st.nbytes()

        def freed(_ref: weakref.ref) -> None:
            self._free(key)

        ref = weakref.ref(st, freed)
        self._live[key] = (nbytes, kind, ref)
        self._now[kind] += nbytes
        self._total += nbytes

    def _note_peak(self) -> None:
        if self._total > self._peak.peak_bytes:
            self._peak = TensorPeak(peak_bytes=self._total, by_kind=dict(self._now))

    def _resized(self, st: torch.UntypedStorage) -> None:
        """A storage's size changed in place (FSDP2 frees and re-allocates its unsharded parameters by resizing
        their storage to 0 and back): count its new size, under the kind it had or as an activation."""
        key = st._cdata
        entry = self._live.get(key)
        if entry is None:
            self._add_storage(st, "temporaries" if torch._C._current_graph_task_id() != -1 else "activations")
            return
        change = st.nbytes() - entry[0]
        self._live[key] = (st.nbytes(), entry[1], entry[2])
        self._now[entry[1]] += change
        self._total += change
        self._note_peak()

    def _free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._now[entry[1]] -= entry[0]
            self._total -= entry[0]

    def _tag_states(self) -> None:
        for module in self._modules:
            for t in [*module.parameters(), *module.buffers()]:
                self._add(t, "params", retag=True)
        self._tag_grads()
        for opt in self._optimizers:
            for state in opt.state.values():
                for t in state.values():
                    if isinstance(t, torch.Tensor):
                        self._add(t, "optimizer", retag=True)

    def _tag_grads(self) -> None:
        for module in self._modules:
            for p in module.parameters():
                if p.grad is not None:
                    self._add(p.grad, "grads", retag=True)

    # --- the mode ----------------------------------------------------------------------------------------------
    def __enter__(self) -> TensorMemory:
        self._tag_states()
        for module in self._modules:
            for p in module.parameters():
                if p.requires_grad:
                    self._hooks.append(
                        p.register_post_accumulate_grad_hook(lambda q: self._add(q.grad, "grads", retag=True))
                    )
        for opt in self._optimizers:
            self._hooks.append(opt.register_step_pre_hook(self._optimizer_starts))
            self._hooks.append(opt.register_step_post_hook(self._optimizer_ends))
        # resize_ is a method of the storage, not an operator the mode sees (torch's MemTracker patches it too)
        self._resize = original = torch.UntypedStorage.resize_

        def resize_(st: torch.UntypedStorage, size: int):
            out = original(st, size)
            self._resized(st)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        super().__exit__(*exc)

    def _optimizer_starts(self, *_args) -> None:
        self._tag_grads()
        self._in_optimizer += 1

    def _optimizer_ends(self, *_args) -> None:
        self._in_optimizer -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # DTensor and other wrappers first run as their local tensors' operators
        out = func(*args, **(kwargs or {}))
        if self._in_optimizer:
            kind = "optimizer"
        elif torch._C._current_graph_task_id() != -1:
            kind = "temporaries"
        else:
            kind = "activations"
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t, kind)
        return out

    # --- results -----------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a new peak window at the bytes alive now (parameters, gradients and optimizer state retagged)."""
        self._tag_states()
        self._peak = TensorPeak(peak_bytes=self._total, by_kind=dict(self._now))

    def peak(self) -> TensorPeak:
        """The largest total of live tensor bytes since the last :meth:`reset`, and its bytes by kind."""
        return self._peak

    def now(self) -> TensorPeak:
        """The live tensor bytes now, by kind."""
        return TensorPeak(peak_bytes=self._total, by_kind=dict(self._now))


def steady_peak(passes: TensorPeak, optimizer_step: TensorPeak, after: TensorPeak) -> TensorPeak:
    """A step's peak as every later step would reach it: ``passes`` (forward and backward, measured from the
    step's start) grown by the optimizer state that exists at its end (``after``) but did not when the passes
    started (a run's first step creates it), or the optimizer step's own peak if larger.

    >>> fb = TensorPeak(peak_bytes=10, by_kind={"params": 2, "optimizer": 0, "activations": 8})
    >>> opt = TensorPeak(peak_bytes=8, by_kind={"params": 2, "optimizer": 4, "activations": 0})
    >>> steady_peak(fb, opt, opt)
    TensorPeak(peak_bytes=14, by_kind={'params': 2, 'optimizer': 4, 'activations': 8})
    """
    created = max(0, after.by_kind.get("optimizer", 0) - passes.by_kind.get("optimizer", 0))
    grown = TensorPeak(
        peak_bytes=passes.peak_bytes + created,
        by_kind={**passes.by_kind, "optimizer": passes.by_kind.get("optimizer", 0) + created},
    )
    return grown if grown.peak_bytes >= optimizer_step.peak_bytes else optimizer_step
