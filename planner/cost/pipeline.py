"""Pipeline schedules: step time from per-rank micro-batch times, and micro-batches held in flight.

Notation: ``p`` pipeline ranks, ``m`` micro-batches per step, ``v`` model chunks per rank (virtual
stages; 1 unless interleaved). ``T_r`` is the time pp rank ``r`` spends on ONE micro-batch over all of
its chunks: forward + backward + recompute + exposed TP collectives + pipeline send/recv (layout changes
included), i.e. a sum of :class:`planner.cost.config.LayerCost` terms plus per-chunk p2p terms.

Step time (the exact formula the ILP reproduces; all terms are sums and maxima of LayerCost pieces)::

    pipeline_s = (m - 1/v) * max_r T_r + (1/v) * sum_r T_r                                       (P)
    step_s     = pipeline_s + max_r ( dp_sync_exposed_r + zero_comm_r + optimizer_r )           (S)

(P) with v = 1 is the classic fill-and-drain bound of GPipe and 1F1B, ``(m - 1) max_r T_r + sum_r T_r``
(Huang et al. 2019; Narayanan et al. 2019, PipeDream-Flush): the slowest rank runs ``m`` micro-batches
back to back while the others fill and drain once. For equal ``T_r = T`` it is ``(m + p - 1) T``, i.e. a
bubble of ``(p - 1)/m`` of the ideal ``m T`` (Narayanan et al. SC21 §2.2.1). Interleaving (SC21 §2.2.2)
runs the fill and drain in chunks ``v`` times smaller: ``(m + (p - 1)/v) T``, bubble ``(p - 1)/(m v)``.
Interleaving pays ``v`` times more p2p messages, which appear in ``T_r`` as per-chunk send/recv terms.
GPipe and 1F1B have the same time (1F1B only bounds memory); they differ in ``inflight_microbatches``.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.core import SCHEDULES, StratagemError


def _check(schedule: str, pp: int, num_micro_batches: int, virtual_stages: int) -> None:
    if schedule not in SCHEDULES:
        raise StratagemError(f"unknown pipeline schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    if pp < 1 or num_micro_batches < 1 or virtual_stages < 1:
        raise StratagemError(
            f"pp={pp}, micro-batches={num_micro_batches} and virtual stages={virtual_stages} must all be >= 1"
        )
    if schedule != "interleaved_1f1b" and virtual_stages != 1:
        raise StratagemError(
            f"{schedule} runs one chunk per rank but virtual_stages={virtual_stages}; "
            f"use --schedule interleaved_1f1b or --virtual-stages 1"
        )


def pipeline_step_time(
    rank_times_s: Sequence[float], num_micro_batches: int, virtual_stages: int = 1, schedule: str = "1f1b"
) -> float:
    """Seconds for ``m`` micro-batches through the pipeline, formula (P) of the module docstring.

    >>> pipeline_step_time([1.0, 1.0, 1.0, 1.0], 8)            # (8 + 4 - 1) * 1
    11.0
    >>> pipeline_step_time([1.0] * 4, 8, 2, "interleaved_1f1b")  # (8 + 3/2) * 1
    9.5
    """
    if not rank_times_s:
        raise StratagemError("pipeline_step_time needs one time per pipeline rank, got none")
    _check(schedule, len(rank_times_s), num_micro_batches, virtual_stages)
    v = virtual_stages
    return (num_micro_batches - 1.0 / v) * max(rank_times_s) + sum(rank_times_s) / v


def inflight_microbatches(
    schedule: str, pp: int, pp_rank: int, num_micro_batches: int, virtual_stages: int = 1
) -> float:
    """Micro-batches whose activations pp rank ``pp_rank`` holds at its peak, in whole-rank units.

    Multiply by the activation bytes of ALL the rank's chunks for one micro-batch.

    - GPipe: all ``m`` forwards run before any backward (Huang et al. 2019).
    - 1F1B: rank ``s`` runs ``p - s - 1`` warm-up forwards plus one, so it holds ``min(p - s, m)``
      (Narayanan et al. SC21 §2.2.1; Korthikanti et al. 2022 §4.2.3).
    - Interleaved 1F1B: Megatron-LM's warm-up is ``2 (p - s - 1) + (v - 1) p`` chunk-forwards, plus one
      in flight, capped at ``m v`` (megatron/core/pipeline_parallel/schedules.py,
      ``forward_backward_pipelining_with_interleaving``); divided by ``v`` chunks per rank. For the first
      rank this is ``p (1 + (p - 1)/(p v))``, Korthikanti et al. §4.2.3's factor.
    """
    _check(schedule, pp, num_micro_batches, virtual_stages)
    if not 0 <= pp_rank < pp:
        raise StratagemError(f"pp_rank {pp_rank} is outside 0..{pp - 1}")
    m, v = num_micro_batches, virtual_stages
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b" or v == 1:
        return float(min(pp - pp_rank, m))
    chunk_forwards = 2 * (pp - pp_rank - 1) + (v - 1) * pp + 1
    return min(chunk_forwards, m * v) / v


def pipeline_aliases_input(model) -> bool:
    """Whether every layer a pipeline chunk can start with saves its whole input for its backward (its saved
    bytes at least its input's, as norms, linears and checkpointed blocks do), so that the activation a chunk
    receives is the input its first layer saves (``estimate._Assembler._pipeline_bytes``). ``model``: the
    :class:`planner.profile.load.ModelProfile`."""
    return all(layer.shards[0].saved_bytes_per_sample >= layer.input_bytes_per_sample for layer in model.layers[1:])
