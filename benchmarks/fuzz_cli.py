"""Fuzz the whole CLI in-process and print totals per class and per subcommand.

    python benchmarks/fuzz_cli.py [--mutations 120] [--hypothesis 300] [--timeout-s 20] [--show 20]

Every case is one command line run by ``planner.cli.main.main`` in this process under a SIGALRM limit (no
torchrun is started: the calls that would start one count as "the input was accepted"). The goal, from
issue 12: 0 tracebacks, 0 hangs, 0 exit-0 on garbage, 0 files replaced. Cases: ``tests/fuzz_harness.py``.
Exit status 1 when any case is a finding.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import fuzz_harness as fz


def _print_table(title: str, table: dict) -> None:
    kinds = ["error", "ok", *fz.BAD_KINDS]
    print(f"\n{title}")
    print(f"{'':18}" + "".join(f"{k[:11]:>12}" for k in ["cases", *kinds]))
    total = {k: 0 for k in kinds}
    for name, counts in sorted(table.items()):
        print(f"{name:18}" + f"{sum(counts.values()):>12}" + "".join(f"{counts.get(k, 0):>12}" for k in kinds))
        for k in kinds:
            total[k] += counts.get(k, 0)
    print(f"{'total':18}" + f"{sum(total.values()):>12}" + "".join(f"{total[k]:>12}" for k in kinds))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mutations", type=int, default=120, help="mutations per real document")
    parser.add_argument("--hypothesis", type=int, default=300, help="hypothesis-drawn command lines")
    parser.add_argument("--timeout-s", type=float, default=20.0, help="limit per case, seconds")
    parser.add_argument("--show", type=int, default=30, help="findings to list")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=None, help="run only this class of cases, e.g. numeric-flag")
    parser.add_argument("--trace", action="store_true", help="print each case before it runs (stderr)")
    args = parser.parse_args()
    import logging

    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="stratagem-fuzz-") as tmp:
        w = fz.build_workdir(Path(tmp))
        cases = fz.all_cases(
            w, mutations_per_document=args.mutations, hypothesis_examples=args.hypothesis, seed=args.seed
        )
        cases = [c for c in cases if args.only in (None, c.klass)]
        started = time.perf_counter()
        outcomes = []
        for i, case in enumerate(cases):
            if args.trace:
                print(f"[{i}] {case.command}: {case.note}", file=sys.stderr, flush=True)
            outcomes.append(fz.run_case(case, w, timeout_s=args.timeout_s))
            if (i + 1) % 200 == 0:
                print(f"... {i + 1}/{len(cases)} cases, {time.perf_counter() - started:.0f} s", file=sys.stderr)
        wall = time.perf_counter() - started
    _print_table("per class", fz.totals(outcomes, "klass"))
    _print_table("per subcommand", fz.totals(outcomes, "command"))
    bad = fz.failures(outcomes)
    slowest = max(outcomes, key=lambda o: o.seconds)
    print(
        f"\n{len(outcomes)} cases in {wall:.0f} s (slowest {slowest.seconds:.1f} s: {slowest.case.note}); "
        f"{len(bad)} findings"
    )
    for o in bad[: args.show]:
        print(f"  {o.kind:16} {o.case.command:15} {o.case.note[:60]:60} {o.detail[:160]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
