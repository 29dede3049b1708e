"""Where a rank sits in the plan's mesh, and the DeviceMesh built from it.

Ranks are laid out row-major over ``plan.mesh.axes`` (last axis fastest), exactly as ``planner.plan.schema``
documents, so the coordinates computed here agree with the ranks each ``Stage`` lists.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.plan import Plan

AXES = ("pp", "dp", "tp")
ALL_AXES = ("pp", "dp", "cp", "tp")  # with context parallelism (the plan's mesh then names cp)


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelDims:
    """Degrees of the axes (``pp``, ``dp``, ``cp``, ``tp``) and the order ranks are laid out in."""

    pp: int
    dp: int
    tp: int
    cp: int = 1
    axes: tuple[str, ...] = AXES

    @classmethod
    def from_plan(cls, plan: Plan) -> "ParallelDims":
        return cls(
            pp=plan.mesh.size("pp"),
            dp=plan.mesh.size("dp"),
            tp=plan.mesh.size("tp"),
            cp=plan.mesh.size("cp"),
            axes=tuple(plan.mesh.axes),
        )

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def size(self, axis: str) -> int:
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}[axis]

    def coords(self, rank: int) -> dict[str, int]:
        """``{"pp": i, "dp": j, "tp": k}`` of a global rank (row-major over ``axes``; ``cp`` too when the
        mesh has that axis).

        >>> ParallelDims(pp=2, dp=2, tp=2).coords(5)
        {'pp': 1, 'dp': 0, 'tp': 1}
        >>> ParallelDims(pp=1, dp=2, cp=2, tp=1, axes=("pp", "dp", "cp", "tp")).coords(1)
        {'pp': 0, 'dp': 0, 'cp': 1, 'tp': 0}
        """
        out: dict[str, int] = {a: 0 for a in ALL_AXES}
        rest = rank
        for axis in reversed(self.axes):
            out[axis] = rest % self.size(axis)
            rest //= self.size(axis)
        return {a: out[a] for a in ALL_AXES if a != "cp" or a in self.axes}

    def rank_of(self, **coords: int) -> int:
        """Inverse of :meth:`coords`: the global rank at the given axis coordinates (missing ones 0)."""
        rank = 0
        for axis in self.axes:
            rank = rank * self.size(axis) + coords.get(axis, 0)
        return rank


def build_mesh(dims: ParallelDims, device_type: str):
    """A ``DeviceMesh`` with one named dimension per plan axis (size-1 axes included).

    Sub-meshes are then ``mesh["tp"]``, ``mesh["dp"]``, ``mesh["pp"]``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, tuple(dims.size(a) for a in dims.axes), mesh_dim_names=dims.axes)
