"""Helpers of the model profiler: FLOPs, saved-for-backward bytes and timings of one module."""
