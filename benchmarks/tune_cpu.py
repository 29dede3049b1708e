"""`stratagem tune run` against the measured ground truth on this machine's CPU ranks (issue 28).

    .venv/bin/python benchmarks/tune_cpu.py [--models gpt:small,llama:tiny] [--trials 5] [--steps 6]
                                            [--out benchmarks/data/cpu/tune]

For each model, on 2 CPU ranks (cluster ``local-cpu-2core``, global batch 16, 64 tokens per sample, fp32):

1. the model profile: the shipped one for gpt:small, else measured here (``stratagem profile model``, micro-batches
   1-16, tp 1 and 2) into ``--out``;
2. ground truth: every candidate ``tune run`` chooses from (the uncalibrated search's best plan of each outer
   choice: tp/pp/dp, micro-batch, schedule, ZeRO, sp; all of them, not a pool) launched once for ``--steps`` steps
   through the same launcher ``tune run`` uses; the ``REPEATED`` fastest launched again, the fastest of the two
   kept, and the median relative gap between a repeat pair reported as the measurement noise;
3. ``stratagem tune run --trials T`` from scratch (its own launches, nothing reused from step 2);
4. regret: the ground-truth time of the configuration ``tune run`` ended with over the ground-truth best, against
   the measurement noise it states (its trials' median step spread, at least 3 %) and the repeat noise of step 2;
5. the same sitting (``--recheck R``, default 3): the configuration ``tune run`` ended with and the ``RECHECKED``
   fastest of the ground truth launched again in turn, R rounds; the regret on their medians from this sitting
   alone. This machine's speed drifts between sittings (gpt:small's best configurations measured 0.08-0.10 s on
   2026-11-28 and 0.13-0.16 s on 2026-11-29), so a ground truth from another day cannot judge a regret of a few
   per cent; configurations launched in turn see the same drift.

``--tune-only`` reruns step 3 against the ground truth already in ``--out``; ``--show`` prints the saved results.

Configurations are matched by their summary (degrees, micro-batch, schedule, ZeRO, recompute, sp). Everything runs
on this machine's two cores: run it with nothing else busy. Writes ``--out/<model>.json`` and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.cli.cmd_plan import full_spec  # noqa: E402
from planner.cli.cmd_tune_run import launch_trial  # noqa: E402
from planner.model import parse_model  # noqa: E402
from planner.plan import TrainingSettings, load_plan  # noqa: E402
from planner.profile import load_cluster_profile, load_model_profile, resolve_cluster_path  # noqa: E402
from planner.search import SearchConfig  # noqa: E402
from planner.tune import Target, label  # noqa: E402
from planner.tune import candidate_pool  # noqa: E402

CLUSTER = "local-cpu-2core"
GPUS, BATCH, SEQ = 2, 16, 64
REPEATED = 5  # the fastest this many are launched a second time
RECHECKED = 3  # the fastest this many of the ground truth are launched again beside the chosen one (step 5)
SHIPPED = {"gpt:small": ROOT / "profiles" / "models" / "gpt-small.json"}


def stratagem(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "planner.cli.main", *args], check=True, cwd=ROOT)


def model_profile(model: str, out: Path) -> Path:
    if model in SHIPPED:
        return SHIPPED[model]
    path = out / f"{model.replace(':', '-')}-s{SEQ}.json"
    if not path.exists():
        stratagem(
            "profile", "model", "--model", model, "--micro-batch", "1,2,4,8,16", "--seq", str(SEQ),
            "--tp", "1,2", "--dtype", "fp32", "--out", str(path),
        )  # fmt: skip
    return path


def every_candidate(model: str, profile_path: Path) -> list:
    """(run, plan) of every candidate ``tune run`` chooses from, on the uncalibrated cluster."""
    spec = full_spec(parse_model(model))
    profile = load_model_profile(profile_path)
    cluster = load_cluster_profile(resolve_cluster_path(CLUSTER))
    target = Target(model=model, spec=spec, seq=SEQ, gpus=GPUS, global_batch=BATCH, dtype=profile.dtype)
    training = TrainingSettings(global_batch=BATCH, seq_len=SEQ, dtype=profile.dtype)
    return candidate_pool(target, spec, profile, cluster, training, SearchConfig(), pool=256)


def ground_truth(model: str, profile_path: Path, folder: Path, steps: int) -> list[dict]:
    pool = every_candidate(model, profile_path)
    args = argparse.Namespace(steps=steps, trial_timeout_s=300.0, compile=None)
    rows = []
    for number, (run, plan) in enumerate(pool, start=1):
        outcome = launch_trial(plan, number, folder=folder, args=args)
        rows.append(
            {
                "configuration": label(run.config),
                "status": outcome.status,
                "measured_s": outcome.step_time_s,
                "predicted_s": plan.predictions.step_time_s if plan.predictions else None,
                "repeat_s": None,
            }
        )
        print(f"  {number:2d}/{len(pool)} {rows[-1]['configuration']:45s} {outcome.status} {outcome.step_time_s}")
    ok = sorted((r for r in rows if r["measured_s"]), key=lambda r: r["measured_s"])
    for i, row in enumerate(ok[:REPEATED]):
        plan = next(p for (run, p) in pool if label(run.config) == row["configuration"])
        outcome = launch_trial(plan, 900 + i, folder=folder, args=args)
        row["repeat_s"] = outcome.step_time_s
    return rows


def _times(row: dict) -> list[float]:
    return [t for t in (row["measured_s"], row["repeat_s"], *row.get("more_s", [])) if t]


def refine(model: str, profile_path: Path, truth: list[dict], folder: Path, steps: int, n: int) -> None:
    """Launch the ``n`` fastest configurations (best of their launches so far) twice more each (``more_s``)."""
    plans = {label(run.config): plan for run, plan in every_candidate(model, profile_path)}
    args = argparse.Namespace(steps=steps, trial_timeout_s=300.0, compile=None)
    fastest = sorted((r for r in truth if r["measured_s"]), key=lambda r: min(_times(r)))[:n]
    for i, row in enumerate(fastest):
        for j in range(2):
            outcome = launch_trial(plans[row["configuration"]], 800 + 2 * i + j, folder=folder, args=args)
            row.setdefault("more_s", []).append(outcome.step_time_s)
        print(f"  refined {row['configuration']:45s} {[round(t, 4) for t in _times(row)]}")


def recheck(model: str, profile_path: Path, truth: list[dict], chosen: tuple[str, Path], folder: Path, steps: int,
            rounds: int):  # fmt: skip
    """Step 5: the chosen configuration (its label and the plan ``tune run`` wrote) and the ``RECHECKED`` fastest of
    the ground truth, launched in turn for ``rounds`` rounds; configuration -> its step times from this sitting."""
    plans = {label(run.config): plan for run, plan in every_candidate(model, profile_path)}
    plans[chosen[0]] = load_plan(chosen[1])
    args = argparse.Namespace(steps=steps, trial_timeout_s=300.0, compile=None)
    fastest = [r["configuration"] for r in sorted((r for r in truth if r["measured_s"]), key=lambda r: min(_times(r)))]
    names = list(dict.fromkeys([chosen[0], *fastest[:RECHECKED]]))
    times: dict[str, list[float]] = {name: [] for name in names}
    for k in range(rounds):
        for i, name in enumerate(names):
            outcome = launch_trial(plans[name], 700 + k * len(names) + i, folder=folder, args=args)
            if outcome.step_time_s:
                times[name].append(outcome.step_time_s)
        print(f"  recheck round {k + 1}/{rounds}: " + ", ".join(f"{n} {t[-1]:.4f}" for n, t in times.items() if t))
    return times


def sitting(times: dict[str, list[float]], chosen: str) -> dict | None:
    """Regret of ``chosen`` on the medians of one sitting, and that sitting's launch-to-launch noise (None when no
    launch measured)."""
    medians = {name: statistics.median(t) for name, t in times.items() if t}
    if not medians:
        return None
    best = min(medians, key=medians.__getitem__)
    spreads = [statistics.stdev(math.log(x) for x in t) for t in times.values() if len(t) >= 2]
    return {
        "times_s": times,
        "best": best,
        "regret": medians[chosen] / medians[best] - 1 if chosen in medians else None,
        "noise_log_sd_median": statistics.median(spreads) if spreads else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt:small,llama:tiny")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "data" / "cpu" / "tune")
    ap.add_argument(
        "--refine",
        type=int,
        default=0,
        help="with --tune-only: launch the N fastest configurations of the saved ground truth twice more first",
    )
    ap.add_argument(
        "--tune-only", action="store_true", help="reuse the ground truth of an earlier run in --out; run tune alone"
    )
    ap.add_argument("--show", action="store_true", help="print the tables of the results already in --out")
    ap.add_argument(
        "--recheck",
        type=int,
        default=3,
        help="rounds of step 5: the chosen and the fastest ground-truth configurations launched again in turn",
    )
    args = ap.parse_args(argv)
    if args.show:
        for model in args.models.split(","):
            print_result(json.loads((args.out / f"{model.replace(':', '-')}.json").read_text()))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for model in args.models.split(","):
        name = model.replace(":", "-")
        profile_path = model_profile(model, args.out)
        earlier = args.out / f"{name}.json"
        if args.tune_only:
            old = json.loads(earlier.read_text())
            truth, truth_s = old["ground_truth"], old["ground_truth_wall_s"]
            if args.refine:
                t0 = time.perf_counter()
                refine(model, profile_path, truth, args.out / f"{name}-truth", args.steps, args.refine)
                truth_s += time.perf_counter() - t0
        else:
            print(f"{model}: ground truth (every candidate, {args.steps} steps each)")
            t0 = time.perf_counter()
            truth = ground_truth(model, profile_path, args.out / f"{name}-truth", args.steps)
            truth_s = time.perf_counter() - t0
        tuned = args.out / f"{name}-tuned.json"
        t0 = time.perf_counter()
        stratagem(
            "tune", "run", "--model", model, "--model-profile", str(profile_path), "--cluster", CLUSTER,
            "--gpus", str(GPUS), "--global-batch", str(BATCH), "--seq", str(SEQ), "--trials", str(args.trials),
            "--steps", str(args.steps), "--trial-timeout-s", "300", "--out", str(tuned),
        )  # fmt: skip
        tune_s = time.perf_counter() - t0
        record = load_plan(tuned).tune
        assert record is not None
        best_of = {r["configuration"]: min(_times(r)) for r in truth if r["measured_s"]}
        truth_best = min(best_of.values())
        best_config = min(best_of, key=best_of.__getitem__)
        # the loop's own choice: the least geometric mean of a configuration's launches (planner.tune.online)
        launches: dict[str, list[float]] = {}
        for t in record.trials:
            if t.measured_step_time_s:
                launches.setdefault(t.summary, []).append(math.log(t.measured_step_time_s))
        chosen_summary = min(launches, key=lambda k: statistics.fmean(launches[k]))
        chosen = next(t for t in record.trials if t.summary == chosen_summary)
        chosen_truth = best_of.get(chosen.summary)
        pairs = [abs(r["repeat_s"] / r["measured_s"] - 1) for r in truth if r["measured_s"] and r["repeat_s"]]
        spreads = [statistics.stdev(math.log(t) for t in _times(r)) for r in truth if len(_times(r)) >= 3]
        noise = statistics.median(pairs) if pairs else None
        stated = record.measurement_noise_rel
        trials_to_best = next((t.number for t in record.trials if t.summary == chosen.summary), None)
        same = None
        if args.recheck:
            print(f"{model}: the chosen and the {RECHECKED} fastest ground-truth configurations, {args.recheck} rounds")
            times = recheck(model, profile_path, truth, (chosen.summary, tuned), args.out / f"{name}-recheck",
                            args.steps, args.recheck)  # fmt: skip
            same = sitting(times, chosen.summary)
        result = {
            "model": model,
            "cluster": CLUSTER,
            "gpus": GPUS,
            "global_batch": BATCH,
            "seq": SEQ,
            "steps": args.steps,
            "candidates": len(truth),
            "ground_truth": truth,
            "ground_truth_best": {"configuration": best_config, "step_time_s": truth_best},
            "ground_truth_wall_s": truth_s,
            "repeat_noise_median": noise,
            "launch_noise_log_sd_median": statistics.median(spreads) if spreads else None,
            "tune": {
                "trials": [t.model_dump() for t in record.trials],
                "stopped": record.stopped,
                "reason": record.reason,
                "chosen": chosen.summary,
                "chosen_at_trial": trials_to_best,
                "chosen_ground_truth_s": chosen_truth,
                "regret": None if chosen_truth is None else chosen_truth / truth_best - 1,
                "stated_noise": stated,
                "wall_s": tune_s,
            },
            "same_sitting": same,
        }
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
        print_result(result)
    return 0


def print_result(r: dict) -> None:
    print(f"\n{r['model']} on {r['gpus']} CPU ranks, batch {r['global_batch']} x {r['seq']} tokens: ground truth")
    print(f"{'configuration':45s} {'fastest s':>10s} {'launches s':<34s} {'predicted s':>12s}")
    for row in sorted(r["ground_truth"], key=lambda x: min(_times(x)) if x["measured_s"] else 1e9):
        runs = " ".join(f"{t:.4f}" for t in _times(row)) or row["status"]
        best = f"{min(_times(row)):.4f}" if row["measured_s"] else ""
        print(f"{row['configuration']:45s} {best:>10s} {runs:<34s} {row['predicted_s']:12.4f}")
    t = r["tune"]
    print(f"repeat noise (median |repeat / first - 1| of the {REPEATED} fastest): {r['repeat_noise_median']:.1%}")
    if r.get("launch_noise_log_sd_median") is not None:
        spread = r["launch_noise_log_sd_median"]
        print(f"launch-to-launch noise (median sd of log step time over 3+ launches): {spread:.1%}")
    print("tune run trials:")
    for trial in t["trials"]:
        meas = f"{trial['measured_step_time_s']:.4f}" if trial["measured_step_time_s"] else trial["status"]
        pred = trial["predicted_step_time_s"]
        print(f"  {trial['number']}: {trial['summary']:45s} measured {meas}  predicted {pred:.4f}")
    regret = "n/a (not in the ground truth)" if t["regret"] is None else f"{t['regret']:.1%}"
    medians = {x["configuration"]: statistics.median(_times(x)) for x in r["ground_truth"] if len(_times(x)) >= 3}
    if medians and t["chosen"] in medians:
        best = min(medians, key=medians.__getitem__)
        print(
            f"on the median of 3+ launches: best {best} {medians[best]:.4f} s, chosen {medians[t['chosen']]:.4f} s, "
            f"regret {medians[t['chosen']] / medians[best] - 1:.1%}"
        )
    same = r.get("same_sitting")
    if same:
        print("same sitting (launched in turn):")
        for name, times in same["times_s"].items():
            shown = " ".join(f"{x:.4f}" for x in times) or "no launch measured"
            median = f"{statistics.median(times):.4f}" if times else "-"
            print(f"  {name:45s} median {median}  ({shown})")
        noise = "n/a" if same["noise_log_sd_median"] is None else f"{same['noise_log_sd_median']:.1%}"
        regret_now = "n/a (the chosen one measured nothing)" if same["regret"] is None else f"{same['regret']:.1%}"
        print(
            f"  best {same['best']}; chosen {t['chosen']}: regret {regret_now} on this sitting's medians "
            f"(its launch-to-launch noise {noise}; stated noise {t['stated_noise']:.1%})"
        )
    print(
        f"ended with {t['chosen']} (trial {t['chosen_at_trial']} of {len(t['trials'])}, "
        f"{'stopped itself' if t['stopped'] else 'out of trials'}); ground-truth best "
        f"{r['ground_truth_best']['configuration']} {r['ground_truth_best']['step_time_s']:.4f} s; regret {regret} "
        f"(stated noise {t['stated_noise']:.1%}); ground truth took {r['ground_truth_wall_s']:.0f} s, "
        f"tune {t['wall_s']:.0f} s"
    )


if __name__ == "__main__":
    raise SystemExit(main())
