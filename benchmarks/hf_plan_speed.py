"""Wall time of `stratagem plan` for a Llama-3-70B-shaped Hugging Face config on 512 H100s (issue 13's figure).

Writes the config (Dubey et al. 2024, Table 3; meta-llama/Meta-Llama-3-70B config.json values) into a temporary
folder and runs, end to end in a fresh process (imports, meta build, analytic profile, search, plan file):

    stratagem plan --model hf:DIR --cluster dgx-h100 --gpus 512 --global-batch 1024 --seq 8192 --out plan.json

Prints the wall time, the search's own time and its status. Usage: python benchmarks/hf_plan_speed.py [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA3_70B = dict(
    model_type="llama",
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(LLAMA3_70B))
        for _ in range(args.repeats):
            out = Path(tmp) / "plan.json"
            start = time.perf_counter()
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "planner.cli.main",
                    "plan",
                    "--model",
                    f"hf:{tmp}",
                    "--cluster",
                    "dgx-h100",
                    "--gpus",
                    "512",
                    "--global-batch",
                    "1024",
                    "--seq",
                    "8192",
                    "--out",
                    str(out),
                ],
                check=True,
                capture_output=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            wall_s = time.perf_counter() - start
            search = json.loads(out.read_text())["search"]
            with open("/proc/loadavg") as f:
                load = f.read().split()[0]
            print(
                f"wall {wall_s:.2f} s (search {search['wall_time_s']:.2f} s, {search['status']}, "
                f"gap {search['gap']:.2g}); load average {load}"
            )


if __name__ == "__main__":
    main()
