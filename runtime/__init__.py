"""Stratagem runtime: model zoo, model profiler, plan executor, launcher.

Imports only the planner's schemas (``planner.model.spec``, ``planner.profile.load``, ``planner.plan.schema``).
"""
