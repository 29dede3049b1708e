"""Profiles: what a model costs per layer and what a cluster can do, as files.

``schema`` (the pydantic records: :class:`ModelProfile`, :class:`ClusterProfile` and their parts), ``load``
(reading, validating and migrating profile files; the shipped profiles; ``--dtype`` and ``--precision`` help),
``migration`` (older cluster files), ``hardware_catalog`` (cluster profiles derived from datasheets),
``alphabeta`` (fitting measured collectives), and the analytic builders that write a model profile on the meta
device's behalf: ``transformer_layers`` (one block's shapes and shards), ``gpt`` (dense transformers), ``moe``
(routed experts), ``autocast`` (the cast kernels of fp32 weights under ``torch.autocast``).
"""

from planner.profile.alphabeta import bus_factor, fit_alpha_beta
from planner.profile.gpt import build_gpt_profile
from planner.profile.hardware_catalog import build_catalog
from planner.profile.load import (
    DTYPE_HELP,
    PRECISION_HELP,
    PROFILES_DIR,
    CollectiveNeed,
    CollectiveSample,
    FabricLoad,
    ModelProfile,
    Provenance,
    TimingStats,
    default_dtype,
    load_cluster_profile,
    load_model_profile,
    resolve_cluster_path,
    save_profile,
)
from planner.profile.moe import build_moe_profile
from planner.profile.schema import (
    BlockingLatency,
    Calibration,
    ClusterProfile,
    CollectiveFit,
    ComputeFigure,
    ExpertProfile,
    KernelModel,
    LayerProfile,
    LayerTiming,
    NodeGroup,
    NodePower,
    NodeType,
    OpProfile,
    RuntimeOverhead,
    ShardProfile,
    StrictModel,
)

__all__ = [
    "BlockingLatency",
    "Calibration",
    "ClusterProfile",
    "CollectiveFit",
    "CollectiveNeed",
    "CollectiveSample",
    "ComputeFigure",
    "DTYPE_HELP",
    "ExpertProfile",
    "FabricLoad",
    "KernelModel",
    "LayerProfile",
    "LayerTiming",
    "ModelProfile",
    "NodeGroup",
    "NodePower",
    "NodeType",
    "OpProfile",
    "PRECISION_HELP",
    "PROFILES_DIR",
    "Provenance",
    "RuntimeOverhead",
    "ShardProfile",
    "StrictModel",
    "TimingStats",
    "build_catalog",
    "build_gpt_profile",
    "build_moe_profile",
    "bus_factor",
    "default_dtype",
    "fit_alpha_beta",
    "load_cluster_profile",
    "load_model_profile",
    "resolve_cluster_path",
    "save_profile",
]
