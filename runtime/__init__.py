"""Stratagem runtime: model zoo, model profiler, plan executor, launcher.

Imports only the planner's schemas (``planner.modelspec``, ``planner.profiles``, ``planner.plan``).
"""
