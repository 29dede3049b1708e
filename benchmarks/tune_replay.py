"""The tune loop replayed on published grids: regret after 1, 2, 4 and 8 trials (issue 28).

    .venv/bin/python benchmarks/tune_replay.py [--csv benchmarks/data/published_cases.csv]

Grids: the fully specified rows of ``published_cases.csv`` (as ``benchmarks/cost_accuracy.py`` reads them; reference
rows left out) grouped by model, GPU count, sequence and global batch; a group with two configurations or more is a
grid whose every configuration was measured (SC21 Table 2: ZeRO-3 against PTD-P on the same GPUs; SC21 §5 text:
GPT-3 175B on 1,024 GPUs; Korthikanti et al. Table 5: full recompute against selective + sequence parallel;
torchtitan's Llama 3 8B on 64 H100s). No larger measured grid is public in our sources: these are pairs and one
triple, so the replay asks what a pair can: is the first trial (the uncalibrated top prediction) the best, and
when it is not, does the loop measure the other before it stops.

The loop is ``planner.tune``'s: trial 1 is the fastest prediction; after each trial the predictions are scaled by
the measured best's measured / predicted (the one-factor fit one run supports), each unmeasured configuration gets
``P(better)`` and the expected gain of a lognormal step time (``planner.tune.score``), the largest gain is measured
next, and the loop stops when no ``P(better)`` reaches ``STOP_PROBABILITY``. The uncertainty of a prediction
*relative to another of the same grid* is the cross-validated spread of the cost model's errors: the standard
deviation of the difference of log errors over every pair of the *other* grids (leave-one-grid-out; no grid's own
rows inform its uncertainty), at least the 3 % run-to-run floor. Predictions are ``cost_accuracy``'s per row (each
row's cluster, ZeRO-3 model and fabric load).

Row roles are printed: a row that fitted a constant (``calib``) or chose a mechanism (``chose``) is in-sample for
the cost model; the headline regret is over the grids whose rows are all ``validate``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cost_accuracy import DEFAULT_CSV, load_cases, predict  # noqa: E402

from planner.tune import STOP_PROBABILITY, score  # noqa: E402

NOISE_FLOOR = 0.03
TRIALS = (1, 2, 4, 8)


def grids(path: Path) -> list[list]:
    clusters: dict = {}
    cases = [c for c in load_cases(path) if c.role != "reference"]
    by: dict[tuple, list] = {}
    for c in cases:
        key = (c.family, c.layers, c.hidden, c.heads, c.vocab, c.extra_dims, c.gpus, c.seq, c.global_batch)
        by.setdefault(key, []).append(c)
    out = []
    for group in by.values():
        if len(group) >= 2:
            out.append([(c, predict(c, clusters)) for c in group])
    return out


def pair_sigma(others: list[list]) -> float:
    """Std of log(error_i) - log(error_j) over the pairs of every grid in ``others``, at least the noise floor."""
    diffs = []
    for grid in others:
        logs = [math.log(p / c.published_s) for c, p in grid]
        diffs += [a - b for i, a in enumerate(logs) for b in logs[i + 1 :]]
    if not diffs:
        return NOISE_FLOOR
    return max(math.sqrt(statistics.fmean(d * d for d in diffs)), NOISE_FLOOR)


def replay(grid: list, sigma: float) -> tuple[list[float], int]:
    """Regret after each of ``TRIALS`` trials and the number of trials the loop ran before it stopped."""
    true_best = min(c.published_s for c, _ in grid)
    open_ = sorted(range(len(grid)), key=lambda i: grid[i][1])
    measured: list[int] = [open_.pop(0)]
    while open_:
        best = min(measured, key=lambda i: grid[i][0].published_s)
        scale = grid[best][0].published_s / grid[best][1]
        odds = [(i, *score(grid[i][1] * scale, grid[best][0].published_s, sigma)) for i in open_]
        if max(p for _, p, _ in odds) < STOP_PROBABILITY:
            break
        pick = max(odds, key=lambda t: (t[2], -grid[t[0]][1]))[0]
        open_.remove(pick)
        measured.append(pick)
    regrets = []
    for n in TRIALS:
        seen = measured[:n]
        regrets.append(min(grid[i][0].published_s for i in seen) / true_best - 1)
    return regrets, len(measured)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    args = ap.parse_args(argv)
    all_grids = grids(args.csv)
    print(f"{len(all_grids)} measured grids (same model, GPUs, sequence, batch; >= 2 configurations)")
    print(f"{'grid':<44} {'n':>2} {'roles':<18} {'sigma':>6} {'ran':>3}  " + "  ".join(f"after {n}" for n in TRIALS))
    held, every = [], []
    for g, grid in enumerate(all_grids):
        sigma = pair_sigma([x for j, x in enumerate(all_grids) if j != g])
        regrets, ran = replay(grid, sigma)
        c0 = grid[0][0]
        roles = ",".join(sorted({c.role for c, _ in grid}))
        name = f"row {grid[0][0].row}: {c0.label[:24]} on {c0.gpus}"
        cells = "  ".join(f"{100 * r:6.1f}%" for r in regrets)
        print(f"{name[:44]:<44} {len(grid):>2} {roles:<18} {100 * sigma:5.1f}% {ran:>3}  {cells}")
        every.append(regrets)
        if roles == "validate":
            held.append(regrets)
    for title, rows in (("validate grids", held), ("every grid", every)):
        if rows:
            means = "  ".join(f"{100 * statistics.fmean(r[i] for r in rows):6.1f}%" for i in range(len(TRIALS)))
            print(f"mean regret, {title} ({len(rows)}):{'':<20} {means}")
    print("after 1 = the uncalibrated top prediction taken as the answer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
