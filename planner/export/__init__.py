"""Export a plan to Megatron-LM, torchtitan, DeepSpeed or Accelerate, and import their configs.

    export_plan(plan, "megatron", profile=..., cluster=...) -> Export   (text, changes, both estimates)
    import_config("deepspeed", text, ...) -> FrameworkSettings

See ``settings.py`` (the common record), ``nearest.py`` (what each framework can express) and one module
per framework for its format and sources.
"""

from typing import TYPE_CHECKING

from planner.core import lazy_getattr

# name -> submodule, loaded on first use (PEP 562): ``api`` brings in the search (to price the nearest
# configurations), which a command that only reads a framework's settings (``estimate``) must not pay for at start-up
_WHERE = {
    "compare": "api",
    "estimate_config": "api",
    "export_plan": "api",
    "import_config": "api",
    "layer_kinds": "api",
    "TOP_LEVEL_KEYS": "deepspeed",
    "ZERO_KEYS": "deepspeed",
    "parse": "megatron",
    "CAPABILITIES": "nearest",
    "nearest_candidates": "nearest",
    "FRAMEWORKS": "settings",
    "FRAMEWORK_MEMORY": "settings",
    "FrameworkSettings": "settings",
    "chunk_paths": "settings",
    "to_parallel_config": "settings",
}

if TYPE_CHECKING:
    from planner.export.api import compare, estimate_config, export_plan, import_config, layer_kinds
    from planner.export.deepspeed import TOP_LEVEL_KEYS, ZERO_KEYS
    from planner.export.megatron import parse
    from planner.export.nearest import CAPABILITIES, nearest_candidates
    from planner.export.settings import FRAMEWORK_MEMORY, FRAMEWORKS, FrameworkSettings, chunk_paths, to_parallel_config


__getattr__ = lazy_getattr("planner.export", _WHERE)


__all__ = [
    "CAPABILITIES",
    "FRAMEWORKS",
    "FRAMEWORK_MEMORY",
    "FrameworkSettings",
    "TOP_LEVEL_KEYS",
    "ZERO_KEYS",
    "chunk_paths",
    "compare",
    "estimate_config",
    "export_plan",
    "import_config",
    "layer_kinds",
    "nearest_candidates",
    "parse",
    "to_parallel_config",
]
