"""Stratagem planner: profile schemas, cost model, exact ILP search, plan files, inspection.

The planner never imports ``torch.distributed`` or ``runtime``; the CLI (``planner.cli``) is the one
composition root that may.
"""

__version__ = "0.1.0"
