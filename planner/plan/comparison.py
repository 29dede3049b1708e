"""The plan against the user's current framework config, as stored in the plan file (``plan --compare-to``).

Both sides are estimated by the same cost model on the same cluster; ``flag_changes`` lists what to change in
the user's config in the framework's own flag or key names (``planner/export``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ComparisonRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    framework: Literal["megatron", "deepspeed", "torchtitan"]
    source: str = Field(description="the user's config as given (arguments, or the file's path)")
    current_summary: str = Field(description="degrees and schedule of the user's config")
    current_step_time_s: float
    current_peak_memory_bytes: float
    current_fits_in_memory: bool
    plan_step_time_s: float
    plan_peak_memory_bytes: float
    exported_step_time_s: float = Field(description="the plan's nearest config in this framework")
    exported_peak_memory_bytes: float
    speedup: float = Field(description="current_step_time_s / exported_step_time_s")
    flag_changes: list[str] = Field(description="changes to the user's config, in the framework's names")
    plan_changes: list[str] = Field(
        default_factory=list, description="plan features the framework cannot express, and what replaced them"
    )
