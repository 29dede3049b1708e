"""Where a rank sits in the plan's mesh, and the DeviceMesh built from it.

Ranks are laid out row-major over ``plan.mesh.axes`` (last axis fastest), exactly as ``planner.plan.schema``
documents: the coordinates come from the plan's own layout record (``plan.parallel_dims``,
:class:`planner.core.ParallelDims`), so they agree with the ranks each ``Stage`` lists.
"""

from __future__ import annotations

from planner.core import ParallelDims

__all__ = ["build_mesh"]


def build_mesh(dims: ParallelDims, device_type: str):
    """A ``DeviceMesh`` with one named dimension per plan axis (size-1 axes included).

    Sub-meshes are then ``mesh["tp"]``, ``mesh["dp"]``, ``mesh["pp"]``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, tuple(dims.size(a) for a in dims.axes), mesh_dim_names=dims.axes)
