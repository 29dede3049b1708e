"""The plan executor: turns a plan file into a running torch.distributed training job.

One verb per file, torchtitan-style: ``mesh`` (device mesh and rank coordinates), ``stage`` (cut a
pipeline stage by module paths), ``tp`` (``apply_tp``), ``recompute`` (``apply_ac``), ``fsdp``
(``apply_dp`` per ZeRO stage), ``schedule`` (pipeline schedule or plain gradient accumulation),
``data`` (synthetic or file data, sharded by batch shares), ``checkpoint`` (DCP, atomic),
``metrics`` (JSON lines), ``train`` (the per-rank entry point run by torchrun).
"""
