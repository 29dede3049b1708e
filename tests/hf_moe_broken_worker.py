"""torchrun worker for tests/test_hf_moe_ep.py's broken variants: ``tests/moe_grad_worker.py`` with one piece of
hf: expert parallelism deliberately broken, to show the parity checks catch it.

``python -m torch.distributed.run ... tests/hf_moe_broken_worker.py VARIANT OUT_DIR STEPS PLAN...``:

- ``no_exchange``: no dispatch and no combine; each rank runs only the experts it holds on its own rows routed
  to them, and its rows routed to the other ranks' experts get a zero output;
- ``no_expert_sync``: expert gradients are neither reduced over edp nor divided by dp (the losses stay equal:
  AdamW is invariant to a gradient's scale; only the step-1 gradient check sees it).
"""

from __future__ import annotations

import sys

import moe_grad_worker
import torch

from runtime.executor.moe import ExpertGradSync
from runtime.executor.moe_dispatch import ExpertExchange


def _local_only(self, rows: torch.Tensor, counts: torch.Tensor, experts, slots: int = 0) -> torch.Tensor:
    held = [int(k) for k in experts.gate_up_proj.keys()]
    start = int(counts[: held[0]].sum())
    mine = int(counts[held[0] : held[-1] + 1].sum())
    out = torch.zeros_like(rows)
    computed = experts.run_grouped(rows[start : start + mine], counts[held[0] : held[-1] + 1])
    return out.index_copy(0, torch.arange(start, start + mine), computed)


def _no_sync(self) -> None:
    """Nothing: the expert gradients stay each rank's own."""


def main(variant: str, rest: list[str]) -> None:
    if variant == "no_exchange":
        ExpertExchange.__call__ = _local_only  # type: ignore[method-assign]
    elif variant == "no_expert_sync":
        ExpertGradSync.sync = _no_sync  # type: ignore[method-assign]
    else:
        raise SystemExit(f"unknown variant {variant}")
    moe_grad_worker.main(rest[0], int(rest[1]), rest[2:])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
