"""Valid inequalities that tighten the ILP's relaxation without changing its integer optimum.

The hard part of the program is a knapsack per pp rank: how many of its repeated blocks to recompute so
that they fit in memory, inside a max over ranks. The LP relaxation mixes options fractionally and so
under-estimates the slowest rank by up to one block's recompute; branch-and-bound then struggles to close
that gap. :func:`block_time_floor` computes, for every block count ``k`` a rank could hold, the exact
least time of ``k`` blocks under the most generous memory the rank could have (every other term of its
memory at its lower bound). ``(i)``: with one-hot z[r,k] over the rank's block count,
``sum_i n[r,g,i] t_i >= sum_k floor_r(k) z[r,k]``. Every integer solution satisfies it, so the optimum is
unchanged (it is the convex hull of each rank's block knapsack, per count).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from planner.search.ilp_terms import linear
from planner.search.tables import Group, RankModel, Tables

CUT_SLACK = 1e-7  # relative weakening of each cut (keeps exact ties feasible under float rounding)
MAX_OPTIONS = 3  # full enumeration of counts is cubic in the block count; skip larger option sets


def block_time_floor(
    tables: Tables, g: int, r: int, extra_bytes: float = 0.0, inflight: float | None = None
) -> np.ndarray | None:
    """``floor[k]`` = least time of ``k`` layers of group ``g`` on rank ``r`` that can fit (inf if none).

    Memory lower bound used: reserve * (sum n_i (state_i + inflight_r act_i) + working set of the present
    options + DDP buffer of these layers' gradients alone + ZeRO-3 buffer of the largest present layer +
    the pipeline buffers of the rank's chunks at their smallest + ``extra_bytes`` of other layers known
    to be there) + context <= capacity. None when not applicable (more than three options).
    ``inflight``: micro-batches held in flight (default the rank's own; fewer gives a lower floor).
    One rank of :func:`block_time_floors`.
    """
    if inflight is None:
        inflight = tables.inflight[r]
    fixed = extra_bytes + pipeline_floor(tables, r, inflight)
    floors = block_time_floors(tables, g, tables.rank_node_types[r], [(inflight, fixed)])
    return None if floors is None else floors[0]


def block_time_floors(
    tables: Tables, g: int, node_type: str, rows: Sequence[tuple[float, float]], max_count: int | None = None
) -> np.ndarray | None:
    """:func:`block_time_floor` of several ranks of one node type at once: ``rows`` are (micro-batches in
    flight, fixed bytes known to be on the rank: pipeline buffers and other layers); returns an array
    ``floor[row, k]``. None when not applicable (more than three options, or a group of one layer).

    Exact enumeration in O(k^2) per row: options sorted by time (t0 <= t1 <= t2); for each count k and n2 the
    rest splits into n0 + n1 with time falling in n0, so the best n0 is 0, all, or the largest interior
    value the (then linear) memory constraint allows. The rows share one numpy pass (axis 0), which is what
    makes the refined bound of a many-stage pipeline cheap.

    ``max_count``: enumerate counts up to it only and extend the floor beyond with the fastest option's time per
    further layer, ``floor[k] = floor[K] + (k - K) t0``. Still a lower bound: removing a layer from a fitting
    assignment of ``k + 1`` layers leaves a fitting one of ``k`` (memory only falls), so
    ``floor[k + 1] >= floor[k] + t0``.
    """
    group: Group = tables.groups[g]
    rm: RankModel = tables.ranks[node_type]
    costs = sorted(group.costs[node_type], key=lambda c: c.time_s)
    if len(costs) > MAX_OPTIONS or group.size < 2:
        return None
    while len(costs) < MAX_OPTIONS:  # pad with copies of the slowest option (never better)
        costs.append(costs[-1])
    t = [c.time_s for c in costs]
    inflight = np.array([row[0] for row in rows])[:, None]
    fixed = np.array([row[1] for row in rows])[:, None]
    # per-layer bytes of each option: states, and activations times the row's micro-batches in flight
    state = [
        rm.state_bytes_per_param_dp * c.params_dp + rm.state_bytes_per_param_dpt * c.params_dpt + c.state_bytes
        for c in costs
    ]
    each = [state[i] + inflight * costs[i].act_bytes for i in range(MAX_OPTIONS)]
    ws = [c.ws_bytes for c in costs]
    pbytes = [c.param_bytes for c in costs]
    params = [c.params_dp + c.params_dpt for c in costs]
    limit = (rm.capacity_bytes - rm.reserve_const_bytes) / rm.reserve_factor

    def largest_present(n0, n1, n2, values) -> np.ndarray:
        """max over the options present (count > 0) of ``values`` (0 if none)."""
        out = np.where(n0 > 0, values[0], 0.0)
        out = np.maximum(out, np.where(n1 > 0, values[1], 0.0))
        return np.maximum(out, np.where(n2 > 0, values[2], 0.0))

    def memory(n0, n1, n2) -> np.ndarray:
        mem = n0 * each[0] + n1 * each[1] + n2 * each[2] + largest_present(n0, n1, n2, ws) + fixed
        if rm.ddp_buffer == "always":
            mem = mem + np.minimum(
                rm.ddp_buffer_cap_bytes, rm.grad_bytes_per_param * (n0 * params[0] + n1 * params[1] + n2 * params[2])
            )
        if rm.zero3_buffer_layers:
            mem = mem + rm.zero3_buffer_layers * largest_present(n0, n1, n2, pbytes)
        return mem

    size = group.size
    top = size if max_count is None else max(0, min(size, max_count))
    # the (k, n2) pairs with n2 <= k, k-major: axis 1 of every array below (axis 0: the rows)
    k, n2 = _count_pairs(top)
    rest = k - n2
    if np.all(each[0] > each[1]):  # memory grows with n0 inside (0, rest): the largest n0 the limit allows
        slack = limit - memory(np.ones_like(rest), np.maximum(rest - 1, 0), n2)
        interior = np.clip(1 + np.floor(slack / (each[0] - each[1])), 1, np.maximum(rest - 1, 1)).astype(int)
    elif np.all(each[0] <= each[1]):
        interior = np.maximum(rest - 1, 1)
    else:  # rows disagree (an option's activations and states trade places with the micro-batches in flight)
        slack = limit - memory(np.ones_like(rest), np.maximum(rest - 1, 0), n2)
        grows = each[0] > each[1]
        with np.errstate(divide="ignore", invalid="ignore"):
            step = np.where(grows, slack / np.where(grows, each[0] - each[1], 1.0), 0.0)
        interior = np.where(
            grows, np.clip(1 + np.floor(step), 1, np.maximum(rest - 1, 1)), np.maximum(rest - 1, 1)
        ).astype(int)
    best = np.full(np.broadcast_shapes(inflight.shape, k.shape), np.inf)
    # memory(n0, rest - n0, n2) = base + n0 (each0 - each1) + the terms of present options (no row axis)
    base = rest * each[1] + n2 * each[2] + fixed
    step01 = each[0] - each[1]
    for n0 in (np.zeros_like(rest), rest, np.minimum(interior, rest)):
        n1 = rest - n0
        ok = base + n0 * step01 + _present_bytes(rm, n0, n1, n2, ws, pbytes, params) <= limit
        best = np.where(ok, np.minimum(best, n0 * t[0] + n1 * t[1] + n2 * t[2]), best)
    floor = np.minimum.reduceat(best, _pair_starts(top), axis=1)  # least over n2 of each k
    if top < size:  # floor[k] >= floor[top] + (k - top) t0 beyond the enumerated counts
        beyond = floor[:, top : top + 1] + np.arange(1, size - top + 1)[None, :] * t[0]
        floor = np.concatenate([floor, beyond], axis=1)
    return floor


@functools.cache
def _count_pairs(top: int) -> tuple[np.ndarray, np.ndarray]:
    """(k, n2) for 0 <= n2 <= k <= top, k-major: the block counts and slowest-option counts
    :func:`block_time_floors` enumerates (read-only arrays, shared by every call with this ``top``)."""
    k = np.repeat(np.arange(top + 1), np.arange(1, top + 2))
    n2 = np.concatenate([np.arange(c + 1) for c in range(top + 1)])
    k.flags.writeable = n2.flags.writeable = False
    return k, n2


@functools.cache
def _pair_starts(top: int) -> np.ndarray:
    """Where each k's pairs begin in :func:`_count_pairs` (k (k + 1) / 2)."""
    starts = np.arange(top + 1) * np.arange(1, top + 2) // 2
    starts.flags.writeable = False
    return starts


def _present_bytes(rm: RankModel, n0, n1, n2, ws, pbytes, params) -> np.ndarray:
    """The memory terms of :func:`block_time_floors` beyond the per-layer bytes: the largest working set of the
    options present, the DDP buffer of these layers' gradients, ZeRO-3's buffer of the largest present layer."""
    present = (n0 > 0, n1 > 0, n2 > 0)

    def largest(values) -> np.ndarray:
        out = np.where(present[0], values[0], 0.0)
        out = np.maximum(out, np.where(present[1], values[1], 0.0))
        return np.maximum(out, np.where(present[2], values[2], 0.0))

    extra = largest(ws)
    if rm.ddp_buffer == "always":
        grads = rm.grad_bytes_per_param * (n0 * params[0] + n1 * params[1] + n2 * params[2])
        extra = extra + np.minimum(rm.ddp_buffer_cap_bytes, grads)
    if rm.zero3_buffer_layers:
        extra = extra + rm.zero3_buffer_layers * largest(pbytes)
    return extra


def pipeline_floor(tables: Tables, r: int, inflight: float) -> float:
    """A lower bound of pp rank ``r``'s pipeline bytes with ``inflight`` micro-batches in flight
    (``tables.pipeline_bytes``): the boundaries its chunks send, at their smallest, once per micro-batch as receive
    buffers and once per micro-batch in flight as held outputs; nothing for the received boundaries or the logits
    (so the bound depends on the rank only through how many of its chunks send, and ranks share block floors).
    Textbook pipelines: two buffers of each of its chunks' outputs."""
    rm = tables.ranks[tables.rank_node_types[r]]
    if not rm.pp_buffers:
        return 0.0
    if rm.pp_textbook:  # two buffers of each chunk's output (the last chunk's too)
        return 2 * len(range(r, tables.chunks, tables.pp)) * min(g.out_buffer_bytes for g in tables.groups)
    sent = len(range(r, tables.chunks - 1, tables.pp))
    return (tables.m + inflight) * sent * min(grp.out_buffer_bytes for grp in tables.groups)


def blocks_worth_cutting(tables: Tables) -> list[int]:
    """Groups that get the cut: repeated layers (size >= 2) with few options."""
    return [
        g
        for g, grp in enumerate(tables.groups)
        if grp.size >= 2 and all(len(ks) <= MAX_OPTIONS for ks in grp.costs.values())
    ]


def add_block_cuts(prob, tables: Tables, n: dict, rank_total: dict, scale: float) -> int:
    """(i) for every cut group and rank: one-hot z over its feasible block counts, tied to R[g,r], and the
    group's time on the rank >= the floor of its count. Returns the number of cuts added."""
    import pulp

    added = 0
    for g in blocks_worth_cutting(tables):
        grp = tables.groups[g]
        for r in range(tables.pp):
            floor = block_time_floor(tables, g, r)
            if floor is None:
                continue
            counts = [k for k in range(len(floor)) if np.isfinite(floor[k])]
            z = prob.add_variable_dicts(f"z{g}_{r}", counts, cat="Binary")
            prob += (pulp.lpSum(z.values()) == 1, f"i_one_count[{g},{r}]")
            prob += (rank_total[g, r] == linear((z[k], k) for k in counts), f"i_count[{g},{r}]")
            nt = tables.rank_node_types[r]
            own = linear((n[r, g, i], c.time_s) for i, c in enumerate(grp.costs[nt]))
            # weakened by CUT_SLACK: the floor is met with equality by the best split, and presolve's
            # integer rounding of n >= 3.0000000000000004 would otherwise cut that split off
            prob += (
                own * (1 / scale) >= linear((z[k], float(floor[k]) * (1 - CUT_SLACK) / scale) for k in counts),
                f"i_floor[{g},{r}]",
            )
            added += 1
    return added
