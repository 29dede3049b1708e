"""Older cluster-profile versions, read as the current one."""

from __future__ import annotations

from planner.core import StratagemError, content_hash
from planner.profile.hardware_catalog import default_kernel_model


def migrate_cluster_v1(data: dict, *, source: str = "cluster profile") -> dict:
    """A version-1 cluster profile as version 2: its hash is checked, then each GPU node type gets the
    catalog's kernel model for its device (``planner.profile.hardware_catalog.default_kernel_model``; None for CPUs
    and unknown devices, which keep the layer-level roofline)."""
    stored = data.get("content_hash")
    if stored is not None and stored != content_hash(data):
        raise StratagemError(
            f"cluster profile {source} was modified after it was written (content_hash "
            f"mismatch); regenerate it, or delete its content_hash field if the edit was deliberate"
        )
    out = {k: v for k, v in data.items() if k != "content_hash"}
    out["schema_version"] = 2
    types = []
    for nt in data.get("node_types", []):
        km = default_kernel_model(str(nt.get("device", "")))
        types.append({**nt, "kernel_model": km.model_dump(mode="json") if km is not None else None})
    out["node_types"] = types
    return out
