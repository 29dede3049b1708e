"""The parallel layout, as one record: the degrees of every parallel dimension and the order ranks are laid out in.

Every part of Stratagem that holds a layout reads it as a :class:`ParallelDims` (``Plan.parallel_dims``,
``ParallelConfig.parallel_dims``, the search's ``OuterChoice.parallel_dims``, the export's
``FrameworkSettings.parallel_dims``) and the runtime builds its ``DeviceMesh`` from it, so a converter that drops
a degree is caught by comparing two of them (``tests/test_layout_record.py``). A new dimension is added here first
(``docs/ADDING_A_DIMENSION.md``).

Ranks are row-major over ``axes`` (the last axis fastest), the plan file's mesh order: by default ``pp``
outermost, ``tp`` innermost. ``ep`` and ``etp`` are not mesh axes: the Mixture-of-Experts layers regroup each
stage's ``dp x tp`` ranks as ``(edp, ep, etp)`` ("parallel folding", ``planner.plan.ExpertLayout``). ``sd`` is the
spatial group of a 3D-CNN plan.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Final, Literal, TypedDict

from planner.core.errors import StratagemError

MeshAxis = Literal["pp", "dp", "sd", "cp", "tp"]
MESH_AXES: Final[tuple[str, ...]] = ("pp", "dp", "sd", "cp", "tp")
DEFAULT_AXES: Final[tuple[str, ...]] = ("pp", "dp", "tp")


class Degrees(TypedDict):
    """The degree fields of a transformer layout's records (``ParallelDims.degrees``)."""

    pp: int
    dp: int
    cp: int
    tp: int
    ep: int
    etp: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelDims:
    """Degrees of a parallel layout (torchtitan's ``ParallelDims``) and its mesh order.

    >>> d = ParallelDims(pp=2, dp=2, tp=2)
    >>> d.world_size, d.coords(5), d.rank_of(pp=1, tp=1)
    (8, {'pp': 1, 'dp': 0, 'tp': 1}, 5)
    >>> ParallelDims(dp=2, cp=2, axes=("pp", "dp", "cp", "tp")).coords(1)
    {'pp': 0, 'dp': 0, 'cp': 1, 'tp': 0}
    """

    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    sd: int = 1
    ep: int = 1
    etp: int = 1
    axes: tuple[str, ...] = DEFAULT_AXES

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "cp", "tp", "sd", "ep", "etp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise StratagemError(f"parallel degree {name} = {value!r} is not a positive integer; use 1 or more")
        if not set(self.axes) <= set(MESH_AXES) or len(set(self.axes)) != len(self.axes):
            raise StratagemError(f"mesh axes {list(self.axes)} are not distinct axes of {list(MESH_AXES)}; fix them")
        missing = [a for a in MESH_AXES if getattr(self, a) > 1 and a not in self.axes]
        if missing:
            raise StratagemError(f"degree {missing[0]} > 1 needs the mesh axis {missing[0]!r}; add it to the axes")
        ep, etp, dp, tp = self.ep, self.etp, self.dp, self.tp
        if (dp * tp) % (ep * etp):
            raise StratagemError(
                f"ep={ep} x etp={etp} = {ep * etp} does not divide a stage's dp={dp} x tp={tp} = {dp * tp} ranks; "
                f"choose ep x etp dividing dp x tp"
            )

    @classmethod
    def with_axes(cls, **degrees: int) -> "ParallelDims":
        """The default mesh order, with ``cp`` (and ``sd``) as axes where their degree is above 1."""
        axes = tuple(a for a in MESH_AXES if a in DEFAULT_AXES or degrees.get(a, 1) > 1)
        return cls(axes=axes, **degrees)

    @property
    def world_size(self) -> int:
        """Ranks in the mesh: ``pp x dp x sd x cp x tp`` (ep and etp regroup these ranks, they add none)."""
        return self.pp * self.dp * self.sd * self.cp * self.tp

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: copies of each expert shard in a stage (``dp x tp / (ep x etp)``)."""
        return self.dp * self.tp // (self.ep * self.etp)

    def size(self, axis: str) -> int:
        if axis not in MESH_AXES:
            raise StratagemError(f"unknown mesh axis {axis!r}; use one of {list(MESH_AXES)}")
        return getattr(self, axis) if axis in self.axes else 1

    def degrees(self) -> Degrees:
        """The degrees a transformer layout's records carry as fields (``ParallelConfig``, ``OuterChoice``,
        ``FrameworkSettings``: ``pp, dp, cp, tp, ep, etp``), to build one from this record."""
        if self.sd > 1:
            raise StratagemError(
                f"a spatial layout (sd = {self.sd}) has no transformer degrees: the spatial cost model prices it "
                f"(planner.cost.estimate_spatial); calibrate, export and estimate take transformer plans"
            )
        return Degrees(pp=self.pp, dp=self.dp, cp=self.cp, tp=self.tp, ep=self.ep, etp=self.etp)

    def coords(self, rank: int) -> dict[str, int]:
        """``{"pp": i, "dp": j, "tp": k}`` of a global rank (row-major over ``axes``), with ``cp`` and ``sd``
        where the mesh has them."""
        if not 0 <= rank < self.world_size:
            raise StratagemError(
                f"rank {rank} is outside a mesh of {self.world_size} ranks; use 0..{self.world_size - 1}"
            )
        out = {a: 0 for a in MESH_AXES}
        rest = rank
        for axis in reversed(self.axes):
            out[axis] = rest % self.size(axis)
            rest //= self.size(axis)
        return {a: out[a] for a in MESH_AXES if a in DEFAULT_AXES or a in self.axes}

    def rank_of(self, **coords: int) -> int:
        """Inverse of :meth:`coords`: the global rank at the given axis coordinates (missing ones 0)."""
        rank = 0
        for axis in self.axes:
            rank = rank * self.size(axis) + coords.get(axis, 0)
        return rank

    def stage_ranks(self, pp_rank: int) -> list[int]:
        """The global ranks of pipeline rank ``pp_rank``: every coordinate of the other axes, ascending.

        >>> ParallelDims(pp=2, dp=2, tp=2).stage_ranks(1)
        [4, 5, 6, 7]
        >>> ParallelDims(pp=2, dp=2, tp=2, axes=("dp", "pp", "tp")).stage_ranks(1)
        [2, 3, 6, 7]
        """
        if not 0 <= pp_rank < self.pp:
            raise StratagemError(f"pipeline rank {pp_rank} is outside pp = {self.pp}; use 0..{self.pp - 1}")
        others = [a for a in self.axes if a != "pp"]
        grid = itertools.product(*(range(self.size(a)) for a in others))
        return sorted(self.rank_of(pp=pp_rank, **dict(zip(others, at))) for at in grid)
