"""Profiles: load and save the two documents of :mod:`planner.profile.schema` (whose classes this module
re-exports, so ``from planner.profile.load import ModelProfile`` is the one way in), resolve shipped cluster names,
and migrate older cluster files (:func:`planner.profile.migration.migrate_cluster_v1`).
"""

from __future__ import annotations

from pathlib import Path

from planner.core import (
    DTYPES,
    PRECISIONS,
    Dtype,
    Precision,
    StratagemError,
    load_document,
    read_json,
    validate_document,
)
from planner.profile.migration import migrate_cluster_v1
from planner.profile.schema import (
    CLUSTER_PROFILE_SCHEMA_VERSION,
    DTYPE_HELP,
    MODEL_PROFILE_SCHEMA_VERSION,
    PRECISION_HELP,
    PROFILES_DIR,
    SHIPPED_PROFILES_DIR,
    BlockingLatency,
    Calibration,
    ClusterProfile,
    CollectiveFit,
    CollectiveNeed,
    CollectiveOp,
    CollectiveSample,
    ComputeFigure,
    ExpertProfile,
    FabricLoad,
    KernelModel,
    LayerProfile,
    LayerTiming,
    LinkLevel,
    ModelProfile,
    NodeGroup,
    NodeType,
    OpProfile,
    Origin,
    Provenance,
    RuntimeOverhead,
    ShardProfile,
    StrictModel,
    TileShape,
    TimingStats,
    save_profile,
)

__all__ = [
    "SHIPPED_PROFILES_DIR",
    "MODEL_PROFILE_SCHEMA_VERSION",
    "CLUSTER_PROFILE_SCHEMA_VERSION",
    "Dtype",
    "Precision",
    "PRECISIONS",
    "DTYPES",
    "CollectiveOp",
    "LinkLevel",
    "Origin",
    "StrictModel",
    "Provenance",
    "TimingStats",
    "LayerTiming",
    "CollectiveNeed",
    "OpProfile",
    "ShardProfile",
    "RuntimeOverhead",
    "ExpertProfile",
    "LayerProfile",
    "ModelProfile",
    "CollectiveSample",
    "CollectiveFit",
    "ComputeFigure",
    "TileShape",
    "KernelModel",
    "BlockingLatency",
    "NodeType",
    "NodeGroup",
    "FabricLoad",
    "Calibration",
    "ClusterProfile",
    "PROFILES_DIR",
    "DTYPE_HELP",
    "PRECISION_HELP",
    "save_profile",
    "default_dtype",
    "load_cluster_profile",
    "load_model_profile",
    "resolve_cluster_path",
]


def default_dtype(node_types: list[NodeType], cluster_name: str) -> str:
    """The ``--dtype`` default of every command: bf16 where every given node type has a throughput figure for
    it, else fp16, else the first dtype they all have.

    >>> cpu = load_cluster_profile(resolve_cluster_path("local-cpu-2core"))
    >>> default_dtype(cpu.node_types, cpu.name)
    'bf16'
    """
    common = [c.dtype for c in node_types[0].compute if all(nt.has_dtype(c.dtype) for nt in node_types)]
    for preferred in ("bf16", "fp16"):
        if preferred in common:
            return preferred
    if not common:
        raise StratagemError(f"the node types of {cluster_name} share no compute dtype; pass --dtype")
    return common[0]


def resolve_cluster_path(name_or_path: str) -> Path:
    """A shipped cluster profile's name (``dgx-a100-80g``) or a path to a profile file."""
    candidate = Path(name_or_path)
    if candidate.suffix == ".json" or candidate.exists():
        if not candidate.exists():
            raise StratagemError(f"cluster profile {candidate} does not exist; check the path")
        return candidate
    shipped = PROFILES_DIR / "hardware" / f"{name_or_path}.json"
    if shipped.exists():
        return shipped
    names = sorted(p.stem for p in (PROFILES_DIR / "hardware").glob("*.json"))
    raise StratagemError(
        f"unknown cluster {name_or_path!r}; use a shipped one ({', '.join(names)}) or a path to a profile file"
    )


def load_model_profile(path: str | Path) -> ModelProfile:
    """Load and validate a model profile file (errors are one line with the fix)."""
    return load_document(ModelProfile, path, what="model profile", schema_version=MODEL_PROFILE_SCHEMA_VERSION)


def load_cluster_profile(path: str | Path) -> ClusterProfile:
    """Load and validate a cluster profile file (a version-1 file is migrated:
    :func:`planner.profile.migration.migrate_cluster_v1`)."""
    data = read_json(path, what="cluster profile")
    if data.get("schema_version") == 1:
        data = migrate_cluster_v1(data, source=str(path))
    return validate_document(
        ClusterProfile, data, source=str(path), what="cluster profile", schema_version=CLUSTER_PROFILE_SCHEMA_VERSION
    )
