"""``make_plan``: a hand-made plan for tests and benchmarks (no search), filling the plan schema.

Layers are split into ``pp * virtual_stages`` contiguous chunks as evenly as possible (earlier chunks
take the remainder); chunk ``i`` lives on pp rank ``i % pp`` (interleaved placement, Narayanan et al.
SC21 §2.2.1). Ranks are row-major over (pp, dp, tp).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from planner import __version__
from planner.errors import StratagemError
from planner.modelspec import ModelSpec
from planner.plan import LayerLayout, Mesh, Plan, Schedule, Stage, TrainingSettings
from runtime.executor.mesh import ParallelDims


def split_layers(paths: Sequence[str], chunks: int) -> list[list[str]]:
    """Contiguous, as-even-as-possible split of ``paths`` into ``chunks`` lists.

    >>> split_layers(["a", "b", "c", "d", "e"], 2)
    [['a', 'b', 'c'], ['d', 'e']]
    """
    if chunks > len(paths):
        raise StratagemError(f"with {chunks} stages and {len(paths)} layers a stage would hold no layer; "
                             f"reduce pp or virtual stages, or add layers")
    base, extra = divmod(len(paths), chunks)
    out, start = [], 0
    for i in range(chunks):
        n = base + (1 if i < extra else 0)
        out.append(list(paths[start:start + n]))
        start += n
    return out


def _schedule(kind: str, *, global_batch: int, dp: int, num_micro_batches: int, virtual_stages: int,
              batch_shares: list[float] | None, micro_batch_size: int | None) -> Schedule:
    """The plan's schedule; see ``make_plan`` for the micro-batch size of uneven batch shares."""
    if batch_shares is None:
        size = micro_batch_size or max(1, global_batch // (dp * num_micro_batches))
        return Schedule(kind=kind, micro_batch_size=size, num_micro_batches=num_micro_batches,
                        virtual_stages=virtual_stages)
    rows = [max(1, round(share * global_batch)) for share in batch_shares]  # whole or not: the runtime checks
    size = micro_batch_size or math.gcd(*rows)
    return Schedule(kind=kind, micro_batch_size=size, num_micro_batches=max(1, max(rows) // size),
                    virtual_stages=virtual_stages)


def make_plan(spec: ModelSpec, *, pp: int = 1, dp: int = 1, tp: int = 1, schedule: str = "gpipe",
              global_batch: int = 8, seq_len: int = 16, num_micro_batches: int = 1, virtual_stages: int = 1,
              zero_stage: int = 0, split: Sequence[str] = (), batch_shares: list[float] | None = None,
              recompute: Mapping[str, str] | None = None, lr: float = 1e-3, seed: int = 0,
              stage_paths: list[list[str]] | None = None, dtype: str = "fp32",
              sequence_parallel: Sequence[str] = (), micro_batch_size: int | None = None,
              axes: Sequence[str] = ("pp", "dp", "tp")) -> Plan:
    """A valid plan for ``spec`` on a (pp, dp, tp) mesh; ``split`` names the tensor-parallel layers,
    ``sequence_parallel`` the (split) layers that also run sequence-parallel. ``axes``: rank layout,
    outermost first (the planner uses ``dp, pp, tp`` when replicas run on different node types).

    Even split: ``micro_batch_size`` is ``global_batch / (dp * num_micro_batches)``. Uneven
    ``batch_shares``: the runtime runs ``rows_r / micro_batch_size`` micro-batches on replica ``r``
    (``data.split_batch``), so ``micro_batch_size`` defaults to the gcd of the replicas' rows (the largest
    size dividing them all; ``num_micro_batches`` is ignored) and ``num_micro_batches`` is set to the
    busiest replica's count, as the planner does (planner/cost/validate.py ``micro_batches_per_replica``).

    >>> make_plan(parse_model("gpt:tiny"), dp=2, batch_shares=[0.75, 0.25]).schedule.micro_batch_size
    2
    """
    from runtime.models import layer_paths

    dims = ParallelDims(pp=pp, dp=dp, tp=tp, axes=tuple(axes))
    n_chunks = pp * virtual_stages
    chunks = stage_paths or split_layers(layer_paths(spec), n_chunks)
    stages = []
    for i, paths in enumerate(chunks):
        ranks = [dims.rank_of(pp=i % pp, dp=d, tp=t) for d in range(dp) for t in range(tp)]
        rec = {p: m for p, m in (recompute or {}).items() if p in paths}
        stages.append(Stage(index=i, pp_rank=i % pp, module_paths=paths, ranks=ranks, node_type="test",
                            recompute=rec))
    return Plan(
        planner_version=__version__, created_utc="2026-01-01T00:00:00+00:00", model=spec,
        model_profile_hash=None, cluster_name="hand-made", cluster_hash=None,
        training=TrainingSettings(global_batch=global_batch, seq_len=seq_len, dtype=dtype, lr=lr, seed=seed),
        mesh=Mesh(axes=list(axes), sizes=[{"pp": pp, "dp": dp, "tp": tp}[a] for a in axes]),
        schedule=_schedule(schedule, global_batch=global_batch, dp=dp, num_micro_batches=num_micro_batches,
                           virtual_stages=virtual_stages, batch_shares=batch_shares,
                           micro_batch_size=micro_batch_size),
        stages=stages, zero_stage=zero_stage,
        layout={p: LayerLayout(style="split", sequence_parallel=p in sequence_parallel)
                for p in [*split, *(q for q in sequence_parallel if q not in split)]},
        batch_shares=batch_shares)
