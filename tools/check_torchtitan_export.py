"""Load a torchtitan export with torchtitan's own code: run its config function and build the model it names.

    python tools/check_torchtitan_export.py EXPORT.py [EXPORT.py ...]

For each file (a module ``stratagem export --to torchtitan`` writes): import it, call ``stratagem_plan()`` (which
builds torchtitan's ``Trainer.Config`` from torchtitan's own config function, ``ParallelismConfig`` and
``TrainingConfig``), build ``config.model_spec.model`` on the meta device with torchtitan's builder, and print one
JSON line: ``{"file", "flavor", "params", "world_size", "dp_tp_pp_cp"}``. Exit status 1 when a file fails.
torchtitan (installed by ``make venv`` with ``--no-deps``) imports ``triton`` for its MoE kernels; that and other
GPU-only packages, and its data / logging dependencies (``TRAINING_ONLY``), are stand-ins here
(``tools/gpu_stubs.py``), in this process only.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_stubs import install_stubs

# torchtitan's dependencies for data, logging and checkpoints (not installed: make venv adds torchtitan --no-deps)
TRAINING_ONLY = ("tensorboard", "datasets", "tokenizers", "wandb", "grain", "torchdata", "tiktoken", "blobfile",
                 "fsspec", "sentencepiece", "tomli_w", "huggingface_hub", "safetensors", "psutil",
                 "google")  # fmt: skip


def load(path: Path) -> dict:
    import torch

    spec = importlib.util.spec_from_file_location(f"stratagem_export_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.stratagem_plan()
    with torch.device("meta"):
        model = config.model_spec.model.build()
    par = config.parallelism
    dp = par.data_parallel_replicate_degree * par.data_parallel_shard_degree
    return {
        "file": str(path),
        "flavor": config.model_spec.flavor,
        "params": sum(p.numel() for p in model.parameters()),
        "world_size": module.WORLD_SIZE_GPUS,
        "dp_tp_pp_cp": [dp, par.tensor_parallel_degree, par.pipeline_parallel_degree, par.context_parallel_degree],
    }


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    install_stubs(TRAINING_ONLY)
    failed = 0
    for name in argv:
        try:
            print(json.dumps(load(Path(name))))
        except Exception as exc:  # noqa: BLE001 - each file's failure is reported, the others still run
            failed += 1
            print(json.dumps({"file": name, "error": f"{type(exc).__name__}: {exc}"}))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
