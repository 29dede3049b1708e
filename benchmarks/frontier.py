"""Issue 29's case: Llama-3-70B at 8,192 tokens, 2e12 training tokens, on DGX H100 / A100-80GB / H200 from 64 to
4,096 GPUs, with `stratagem frontier` (one exact plan search per row, in one process per CPU core).

    python benchmarks/frontier.py          # run it; write benchmarks/data/frontier/llama3-70b.{csv,png,json}
    python benchmarks/frontier.py --show   # print the stored table and timing

The JSON records the wall time of the whole command (as it printed it), the CPU cores and processes, the date and
the commit; tools/readme_figures.py puts the stored table into README.md. Prices are the profiles' on-demand list
prices (their sources are in profiles/hardware/*.json), energy the facility MWh of the node types' power figures.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as dt
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "benchmarks" / "data" / "frontier"
STEM = "llama3-70b"
ARGS = [
    "frontier", "--model", "llama:llama3-70b", "--seq", "8192", "--global-batch", "2048", "--train-tokens", "2e12",
    "--cluster", "dgx-h100", "--cluster", "dgx-a100-80g", "--cluster", "dgx-h200", "--gpus", "64:4096",
    "--deadline-days", "30",
]  # fmt: skip


def run() -> dict:
    """Run the frontier as a user would (a fresh `stratagem` process) and store its outputs."""
    csv_path, png_path = DATA / f"{STEM}.csv", DATA / f"{STEM}.png"
    cmd = [sys.executable, "-m", "planner.cli.main", *ARGS, "--out", str(csv_path), "--png", str(png_path)]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    wall_s = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"stratagem frontier failed:\n{done.stderr[-3000:]}")
    printed = re.search(r"rows \((\d+) with a plan\) in ([\d.]+) s", done.stdout)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    record = {
        "command": "stratagem " + " ".join(ARGS),
        "frontier_s": float(printed.group(2)) if printed else None,  # what the command printed (its own work)
        "process_s": round(wall_s, 2),  # the whole process, interpreter start included
        "cpu_cores": os.cpu_count(),
        "processes": min(os.cpu_count() or 1, 21),
        "date": dt.date.today().isoformat(),
        "commit": commit.stdout.strip(),
        "stdout": done.stdout,
    }
    (DATA / f"{STEM}.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def stored() -> tuple[list[dict], dict]:
    with open(DATA / f"{STEM}.csv") as fh:
        rows = list(csv.DictReader(fh))
    return rows, json.loads((DATA / f"{STEM}.json").read_text())


def table_text() -> str:
    """The stored table as the command printed it, and the time it took."""
    _, record = stored()
    lines = [line for line in record["stdout"].splitlines() if line.strip()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--show", action="store_true", help="print the stored result instead of running")
    args = parser.parse_args(argv)
    if not args.show:
        DATA.mkdir(parents=True, exist_ok=True)
        with contextlib.redirect_stdout(io.StringIO()):
            run()
    _, record = stored()
    print(table_text())
    print(
        f"(whole process {record['process_s']} s on {record['cpu_cores']} CPU cores, {record['date']}, "
        f"commit {record['commit']})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
