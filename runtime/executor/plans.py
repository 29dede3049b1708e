"""``make_plan``: a hand-made plan for tests and benchmarks (no search), filling the plan schema.

Layers are split into ``pp * virtual_stages`` contiguous chunks as evenly as possible (earlier chunks
take the remainder); chunk ``i`` lives on pp rank ``i % pp`` (interleaved placement, Narayanan et al.
SC21 §2.2.1). Ranks are row-major over (pp, dp, tp).
"""

from __future__ import annotations

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


def make_plan(spec: ModelSpec, *, pp: int = 1, dp: int = 1, tp: int = 1, schedule: str = "gpipe",
              global_batch: int = 8, seq_len: int = 16, num_micro_batches: int = 1, virtual_stages: int = 1,
              zero_stage: int = 0, split: Sequence[str] = (), batch_shares: list[float] | None = None,
              recompute: Mapping[str, str] | None = None, lr: float = 1e-3, seed: int = 0,
              stage_paths: list[list[str]] | None = None, dtype: str = "fp32",
              sequence_parallel: Sequence[str] = ()) -> Plan:
    """A valid plan for ``spec`` on a (pp, dp, tp) mesh; ``split`` names the tensor-parallel layers,
    ``sequence_parallel`` the (split) layers that also run sequence-parallel.

    ``micro_batch_size`` is ``global_batch / (dp * num_micro_batches)`` (for uneven shares it describes
    an even split; each replica's real rows come from ``batch_shares``).
    """
    from runtime.models import layer_paths

    dims = ParallelDims(pp=pp, dp=dp, tp=tp)
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
        mesh=Mesh(sizes=[pp, dp, tp]),
        schedule=Schedule(kind=schedule, micro_batch_size=max(1, global_batch // (dp * num_micro_batches)),
                          num_micro_batches=num_micro_batches, virtual_stages=virtual_stages),
        stages=stages, zero_stage=zero_stage,
        layout={p: LayerLayout(style="split", sequence_parallel=p in sequence_parallel)
                for p in [*split, *(q for q in sequence_parallel if q not in split)]},
        batch_shares=batch_shares)
