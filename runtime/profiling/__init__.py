"""Profilers: the model profiler (``model``) with its helpers (FLOPs, saved-for-backward bytes and timings of
one module: ``measure``, ``overhead``, ``sync_latency``), and the cluster profiler (``cluster``, which launches
the torchrun worker ``cluster_bench``)."""
