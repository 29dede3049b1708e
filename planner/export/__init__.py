"""Export a plan to Megatron-LM, torchtitan, DeepSpeed or Accelerate, and import their configs.

    export_plan(plan, "megatron", profile=..., cluster=...) -> Export   (text, changes, both estimates)
    import_config("deepspeed", text, ...) -> FrameworkSettings

See ``settings.py`` (the common record), ``nearest.py`` (what each framework can express) and one module
per framework for its format and sources.
"""

from planner.export.api import compare, estimate_config, export_plan, import_config, layer_kinds
from planner.export.deepspeed import TOP_LEVEL_KEYS, ZERO_KEYS
from planner.export.megatron import parse
from planner.export.nearest import CAPABILITIES, nearest_candidates
from planner.export.settings import FRAMEWORK_MEMORY, FRAMEWORKS, FrameworkSettings, chunk_paths, to_parallel_config

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
