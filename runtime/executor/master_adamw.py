"""AdamW over bf16 weights that keeps fp32 master weights: the ``bf16-master`` precision scheme.

The model's parameters are bf16 (compute, activations, gradients); this optimizer's state per parameter holds the
fp32 ``master`` copy next to AdamW's fp32 ``exp_avg`` / ``exp_avg_sq`` and ``step`` — the layout of Megatron-LM's
mixed-precision optimizer (Micikevicius et al. 2018, arXiv:1710.03740 §3.1): 2 (weight) + 2 (gradient) + 12
(master, moments) bytes per parameter. Each step reads the bf16 gradient, updates the master weight and moments in
fp32 and writes the master rounded to bf16 back into the parameter.

Kernels: on CUDA with Triton, one fused kernel per parameter does all of that in one pass, so no cast kernel runs
(autocast instead casts every fp32 weight to bf16 in each forward and every bf16 gradient to fp32 in each backward:
4-7 % of device time on one H200, ``benchmarks/data/h200``). Elsewhere (CPU, or CUDA without Triton) the same
arithmetic runs as torch multi-tensor ops with the two casts explicit. Both follow ``torch.optim.AdamW``
(decoupled weight decay, bias-corrected moments, ``amsgrad`` off).

State lives in ``self.state[param]`` like any torch optimizer, keyed by the model's parameters, so
``torch.distributed.checkpoint``'s optimizer state dicts (``runtime/executor/checkpoint.py``) save and restore the
master weights with the moments. A DTensor parameter keeps DTensor state; the kernels run on the local shards.
"""

from __future__ import annotations

import math

import torch

BLOCK = 2048  # elements per Triton program


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's local tensor of a DTensor, else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


_KERNEL = None


def triton_kernel():
    """The fused update kernel, or None when Triton cannot be imported (compiled once per process)."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL or None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        _KERNEL = False
        return None

    @triton.jit
    def adamw_master_kernel(
        param_ptr, grad_ptr, master_ptr, m_ptr, v_ptr, n, beta1, beta2, eps, decay, step_size, inv_sqrt_bc2,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(master_ptr + offs, mask=mask, other=0.0)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        m = m + (1.0 - beta1) * (g - m)  # torch's lerp form
        v = beta2 * v + (1.0 - beta2) * g * g
        w = w * decay - step_size * m / (tl.sqrt(v) * inv_sqrt_bc2 + eps)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        tl.store(master_ptr + offs, w, mask=mask)
        tl.store(param_ptr + offs, w.to(param_ptr.dtype.element_ty), mask=mask)

    _KERNEL = adamw_master_kernel
    return _KERNEL


class MasterAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` semantics over low-precision parameters with fp32 master weights (module docstring).

    ``kernel``: ``"triton"`` (fused, CUDA), ``"torch"`` (multi-tensor ops) or ``"auto"`` (Triton on CUDA when it
    imports, else torch)."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        kernel: str = "auto",
    ) -> None:
        if kernel not in ("auto", "triton", "torch"):
            raise ValueError(f"kernel must be auto, triton or torch, not {kernel!r}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.kernel = kernel

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader casts every floating-point state tensor to its parameter's dtype, which would round the
        fp32 master weights and moments to bf16 (a DCP resume goes through here): they are put back as saved."""
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for index, param in zip(ids, params):
            for key in ("master", "exp_avg", "exp_avg_sq"):
                value = saved.get(index, {}).get(key)
                if isinstance(value, torch.Tensor) and param in self.state:
                    self.state[param][key] = value.to(device=_local(param).device, dtype=torch.float32)

    def _use_triton(self, device: torch.device) -> bool:
        if self.kernel == "torch" or (self.kernel == "auto" and device.type != "cuda"):
            return False
        if triton_kernel() is None:
            if self.kernel == "triton":
                raise RuntimeError("MasterAdamW(kernel='triton'): Triton is not installed; use kernel='auto'")
            return False
        return True

    def _state_of(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        if "master" not in st:  # a fresh optimizer, or a checkpoint saved without master weights
            master = p.detach().to(torch.float32, copy=True)
            st["master"] = master
            st.setdefault("exp_avg", torch.zeros_like(master))
            st.setdefault("exp_avg_sq", torch.zeros_like(master))
            st.setdefault("step", torch.tensor(0.0))
        return st

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr = float(group["lr"])
            beta1, beta2 = group["betas"]
            hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"], wd=group["weight_decay"])
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self._state_of(p) for p in params]
            torch._foreach_add_([st["step"] for st in states], 1)
            if self._use_triton(_local(params[0]).device):
                self._triton_update(params, states, **hyper)
            else:
                self._torch_update(params, states, **hyper)
        return loss

    @staticmethod
    def _triton_update(params, states, *, lr, beta1, beta2, eps, wd) -> None:
        """One kernel launch per parameter (any dtypes)."""
        single = triton_kernel()
        for p, st in zip(params, states):
            lp, lg = _local(p), _local(p.grad).contiguous()
            n = lp.numel()
            if n == 0:
                continue
            t = float(st["step"])
            bc1, bc2 = 1 - beta1**t, 1 - beta2**t
            single[(-(-n // BLOCK),)](  # ceil(n / BLOCK) programs
                lp, lg, _local(st["master"]), _local(st["exp_avg"]), _local(st["exp_avg_sq"]), n,
                beta1, beta2, eps, 1.0 - lr * wd, lr / bc1, 1.0 / math.sqrt(bc2), BLOCK=BLOCK,
            )  # fmt: skip

    @staticmethod
    def _torch_update(params, states, *, lr, beta1, beta2, eps, wd) -> None:
        """torch multi-tensor ops (CPU, or no Triton): the casts are explicit kernels here."""
        local = [_local(p) for p in params]
        grads = [_local(p.grad).to(torch.float32) for p in params]
        masters = [_local(st["master"]) for st in states]
        ms = [_local(st["exp_avg"]) for st in states]
        vs = [_local(st["exp_avg_sq"]) for st in states]
        if wd:
            torch._foreach_mul_(masters, 1.0 - lr * wd)
        torch._foreach_lerp_(ms, grads, 1.0 - beta1)
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, grads, grads, value=1.0 - beta2)
        for w, m, v, st in zip(masters, ms, vs, states):  # per tensor: a checkpoint may hold unequal step counts
            t = float(st["step"])
            denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
            w.addcdiv_(m, denom, value=-lr / (1 - beta1**t))
        torch._foreach_copy_(local, masters)
