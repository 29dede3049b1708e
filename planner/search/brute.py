"""Brute-force enumeration of every assignment of a small candidate, for testing the ILP.

:func:`brute_force_tables` tries every contiguous split into chunks and every option of every single
layer (no aggregation: each layer of a group chooses independently, subject only to one style per group)
and evaluates each with :func:`planner.search.tables.evaluate`. :func:`iter_layer_assignments` yields the
same space layer by layer, so a test can also score each one with ``planner.cost.estimate`` directly.
Exponential: keep instances to a handful of layers.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from planner.search.tables import Assignment, Evaluation, Tables, evaluate


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerChoice:
    """One point of the brute-force space: chunk and option index of every layer (flat model order)."""

    chunk_of_layer: tuple[int, ...]
    option_of_layer: tuple[int, ...]


def _splits(n_layers: int, n_chunks: int) -> Iterator[tuple[int, ...]]:
    """Chunk index per layer for every split into ``n_chunks`` non-empty contiguous ranges."""
    for cuts in itertools.combinations(range(1, n_layers), n_chunks - 1):
        bounds = (0, *cuts, n_layers)
        yield tuple(s for s in range(n_chunks) for _ in range(bounds[s], bounds[s + 1]))


def iter_layer_assignments(tables: Tables) -> Iterator[LayerChoice]:
    """Every (split, per-layer option) with one style per group."""
    group_of_layer = [g for g, grp in enumerate(tables.groups) for _ in grp.paths]
    per_group_styles = [grp.styles for grp in tables.groups]
    splits = _splits(len(group_of_layer), tables.chunks)
    if tables.chunk_sizes is not None:  # interleaved: equal chunks, one split
        splits = iter([tuple(s for s, size in enumerate(tables.chunk_sizes) for _ in range(size))])
    for chunk_of_layer in splits:
        for styles in itertools.product(*per_group_styles):
            choices = [
                [i for i, o in enumerate(tables.groups[g].options) if o.style == styles[g]] for g in group_of_layer
            ]
            for option_of_layer in itertools.product(*choices):
                yield LayerChoice(chunk_of_layer=chunk_of_layer, option_of_layer=option_of_layer)


def to_assignment(tables: Tables, choice: LayerChoice) -> Assignment:
    """Aggregate a per-layer choice into chunk x group x option counts."""
    counts = [[[0] * len(grp.options) for grp in tables.groups] for _ in range(tables.chunks)]
    group_of_layer = [g for g, grp in enumerate(tables.groups) for _ in grp.paths]
    for layer, g in enumerate(group_of_layer):
        counts[choice.chunk_of_layer[layer]][g][choice.option_of_layer[layer]] += 1
    return Assignment(counts=tuple(tuple(tuple(row) for row in chunk) for chunk in counts))


def brute_force_tables(tables: Tables) -> tuple[Evaluation, LayerChoice] | None:
    """The fastest assignment that fits in memory, or None when nothing fits."""
    best: tuple[Evaluation, LayerChoice] | None = None
    for choice in iter_layer_assignments(tables):
        ev = evaluate(tables, to_assignment(tables, choice))
        if ev.fits and (best is None or ev.step_s < best[0].step_s):
            best = (ev, choice)
    return best
