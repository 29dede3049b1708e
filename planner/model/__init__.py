"""What a model is, before anything is measured: :class:`ModelSpec` (family, dimensions, presets, ``hf:``
configs; ``spec``) and the layer tables of the 3D CNNs (``cnn3d``). No cost, no profile, no torch.
"""

from planner.model.cnn3d import SPATIAL_FAMILIES, VolumeLayer, norm_groups, volume_layers
from planner.model.spec import FAMILY_DEFAULTS, PRESETS, DimValue, Fidelity, ModelSpec, ffn_width, hf_dims, parse_model

__all__ = [
    "DimValue",
    "FAMILY_DEFAULTS",
    "Fidelity",
    "ModelSpec",
    "PRESETS",
    "SPATIAL_FAMILIES",
    "VolumeLayer",
    "ffn_width",
    "hf_dims",
    "norm_groups",
    "parse_model",
    "volume_layers",
]
