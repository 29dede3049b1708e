"""Reshard matrix: a checkpoint written under each layout, resumed under each other layout (issue 30).

    .venv/bin/python benchmarks/reshard_matrix.py [--models gpt:tiny,llama:tiny,moe:tiny] [--out DIR]

For each model (fp32, global batch 8, 16 tokens per sample, AdamW) and each layout of :data:`LAYOUTS` the model
can take, a run of ``STEPS`` steps writes a checkpoint after step ``AT`` (``benchmarks/reshard_worker.py``); that
run never stops, so its losses after ``AT`` are the reference. Every other layout then resumes the step-``AT``
checkpoint in a fresh job (fresh weights, then DCP's load into its own shards), saves what it loaded under its own
layout, and trains to step ``STEPS``. Two checks per pair:

- **state**: the checkpoint the target saved right after loading, read whole by one process
  (``runtime.executor.checkpoint.read_full_checkpoint``), equals the source checkpoint read the same way, entry by
  entry: every parameter and AdamW state tensor (exp_avg, exp_avg_sq, step) bit for bit, every hyper-parameter;
- **losses**: the resumed steps' losses within ``LOSS_RTOL`` (relative) of the run that never stopped.

Three process groups run it all: 2 ranks write the 2-rank layouts' checkpoints; 4 ranks write the 4-rank ones
and resume every checkpoint on 4 ranks; 2 ranks resume every checkpoint on 2 ranks. Prints one matrix per model
(rows: the layout that wrote, columns: the layout that resumed) and the largest differences; exits 1 when a pair
fails.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MODELS = ("gpt:tiny", "gpt:tiny+tied", "llama:tiny", "moe:tiny")  # +tied: LM head tied to the token embedding
STEPS, AT = 5, 2
LOSS_RTOL = 1e-5
GLOBAL_BATCH, SEQ = 8, 16
# the layouts of the matrix; None = the model cannot take it
LAYOUTS = ("dp2", "zero3", "tp2", "pp2", "tp2dp2", "ep2", "cp2", "etp2z3", "etp2dp4z3")
WORKER = REPO / "benchmarks" / "reshard_worker.py"

Launch = Callable[[int, list[str]], None]  # (ranks, argv of python) -> runs it, raising on failure


def layout_kwargs(spec, layout: str) -> dict | None:
    """``make_plan`` arguments of ``layout`` for ``spec``; None when the model cannot take it."""
    from runtime.executor.checks import CONTEXT_FAMILIES
    from runtime.models import is_splittable, layer_paths

    split = [p for p in layer_paths(spec) if is_splittable(spec, p)]
    table = {
        "dp2": dict(dp=2),
        "zero3": dict(dp=2, zero_stage=3),
        "tp2": dict(tp=2, split=split),
        "pp2": dict(pp=2, schedule="1f1b", num_micro_batches=4),
        "tp2dp2": dict(dp=2, tp=2, split=split),
        "ep2": dict(dp=2, experts={"ep": 2}) if spec.is_moe else None,
        "cp2": dict(cp=2) if spec.family in CONTEXT_FAMILIES else None,
        # beyond the list: each expert's FFN split over 2 ranks (its own checkpoint keys per slice), ZeRO-3
        "etp2z3": dict(dp=2, zero_stage=3, experts={"ep": 1, "etp": 2}) if spec.is_moe else None,
        # the same on 4 ranks: each slice sharded over its 2 edp ranks (ZeRO-3 shards of an etp slice)
        "etp2dp4z3": dict(dp=4, zero_stage=3, experts={"ep": 1, "etp": 2}) if spec.is_moe else None,
    }
    return table[layout]


def world(kwargs: dict) -> int:
    return kwargs.get("dp", 1) * kwargs.get("tp", 1) * kwargs.get("pp", 1) * kwargs.get("cp", 1)


def write_plans(models: list[str], root: Path) -> dict[str, dict[str, tuple[Path, int]]]:
    """model -> layout -> (plan file, ranks), for every layout the model can take."""
    from fixtures.plans import make_plan
    from planner.model import parse_model
    from planner.plan import save_plan

    out: dict[str, dict[str, tuple[Path, int]]] = {}
    for name in models:
        spec = parse_model(name.removesuffix("+tied"), tie_embeddings=True if name.endswith("+tied") else None)
        for layout in LAYOUTS:
            kwargs = layout_kwargs(spec, layout)
            if kwargs is None:
                continue
            plan = make_plan(spec, global_batch=GLOBAL_BATCH, seq_len=SEQ, **kwargs)
            path = save_plan(plan, root / "plans" / f"{_slug(name)}-{layout}.json")
            out.setdefault(name, {})[layout] = (path, world(kwargs))
    return out


def _slug(model: str) -> str:
    return model.replace(":", "-").replace("+", "-")


def torchrun(nproc: int, argv: list[str]) -> None:
    """``argv`` on ``nproc`` local ranks under torchrun (gloo, one thread each)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *argv]
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise SystemExit(f"reshard worker failed on {nproc} ranks:\n{(proc.stdout + proc.stderr)[-3000:]}")


def run(
    models: list[str],
    root: Path,
    launch: Launch = torchrun,
    *,
    ring: bool = False,
    only: list[tuple[str, str, str]] | None = None,
) -> list[dict]:
    """Write, resume and compare every pair; one record per (model, source, target). ``ring``: only each layout
    resumed by the next in :data:`LAYOUTS` order (the last by the first), every layout writing once and resuming
    once. ``only``: just these (model, source, target) pairs (the test's share of the matrix)."""
    plans = write_plans(models, root)
    if only is not None:
        pairs = list(only)
        sources = {(m, a) for m, a, _ in pairs}
        plans = {
            m: {a: v for a, v in by.items() if (m, a) in sources or any(p[0] == m and p[2] == a for p in pairs)}
            for m, by in plans.items()
        }
    elif ring:
        pairs = [(m, a, b) for m, by in plans.items() for a, b in zip(by, [*list(by)[1:], next(iter(by))])]
    else:
        pairs = [(m, a, b) for m, by in plans.items() for a in by for b in by if a != b]

    def out(m: str, a: str, b: str | None = None) -> Path:
        return root / _slug(m) / (a if b is None else f"{a}-to-{b}")

    written = {(m, a) for m, a, _ in pairs}

    def save(n: int) -> list[dict]:
        return [
            {"plan": str(p), "out": str(out(m, a))}
            for m, by in plans.items()
            for a, (p, w) in by.items()
            if w == n and (m, a) in written
        ]

    def resume(n: int, writers: tuple[int, ...]) -> list[dict]:
        """Entries resuming on ``n`` ranks the checkpoints written on ``writers`` ranks."""
        return [
            {
                "plan": str(plans[m][b][0]),
                "checkpoint": str(out(m, a) / "ckpt" / f"step_{AT:06d}"),
                "out": str(out(m, a, b)),
            }
            for m, a, b in pairs
            if plans[m][b][1] == n and plans[m][a][1] in writers
        ]

    phases = [
        (2, {"save": save(2)}),
        (4, {"save": save(4), "resume": resume(4, (2, 4))}),
        (2, {"resume": resume(2, (2, 4))}),
    ]
    for i, (n, spec) in enumerate(phases):
        if not any(spec.values()):
            continue
        path = root / f"phase{i}.json"
        path.write_text(json.dumps({**spec, "steps": STEPS, "at": AT}, indent=1))
        launch(n, [str(WORKER), str(path)])
    return [compare(m, a, b, out(m, a), out(m, a, b)) for m, a, b in pairs]


def compare(model: str, source: str, target: str, src: Path, dst: Path) -> dict:
    """The state and loss checks of one pair (module docstring)."""
    import torch

    from runtime.executor.checkpoint import read_full_checkpoint
    from runtime.executor.metrics import final_step_losses, read_metrics

    step = f"step_{AT:06d}"
    before = {k: v for k, v in read_full_checkpoint(src / "ckpt" / step).items() if not k.startswith("rng.")}
    after = {k: v for k, v in read_full_checkpoint(dst / "loaded" / step).items() if not k.startswith("rng.")}
    if model.endswith("+tied"):  # a pp = 1 layout names the shared Parameter's AdamW state once, by the embedding
        from runtime.executor.tied import EMBED, HEAD

        for one, other in ((before, after), (after, before)):
            for key in [k for k in other if HEAD in k and k not in one and k.replace(HEAD, EMBED) in one]:
                one[key] = one[key.replace(HEAD, EMBED)]
    keys_differ = sorted(set(before) ^ set(after))
    state_diff, unequal = 0.0, []
    for key in sorted(set(before) & set(after)):
        x, y = before[key], after[key]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            same = x.shape == y.shape and torch.equal(x, y)
            if x.shape == y.shape and x.is_floating_point():
                state_diff = max(state_diff, float((x - y).abs().max()) if x.numel() else 0.0)
        else:
            same = x == y
        if not same:
            unequal.append(key)
    ref = dict(final_step_losses(read_metrics(src / "metrics.jsonl")))
    got = dict(final_step_losses(read_metrics(dst / "metrics.jsonl")))
    steps = range(AT + 1, STEPS + 1)
    missing = [s for s in steps if s not in got or s not in ref]
    loss_rel = max((abs(got[s] - ref[s]) / abs(ref[s]) for s in steps if s not in missing), default=math.inf)
    ok = not keys_differ and not unequal and not missing and loss_rel <= LOSS_RTOL
    return {
        "model": model,
        "source": source,
        "target": target,
        "entries": len(before),
        "keys_differ": keys_differ[:5],
        "unequal": unequal[:5],
        "max_state_abs_diff": state_diff,
        "max_loss_rel_diff": loss_rel,
        "ok": ok,
    }


def print_matrix(rows: list[dict]) -> None:
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        layouts = list(dict.fromkeys([r["source"] for r in mine] + [r["target"] for r in mine]))
        cell = {(r["source"], r["target"]): r for r in mine}
        print(
            f"\n{model}: checkpoint written under (rows) resumed under (columns); ok = state equal and "
            f"{STEPS - AT} resumed losses within {LOSS_RTOL:g}"
        )
        w = 1 + max(len(x) for x in layouts)
        print(f"{'':>{w}}" + "".join(f"{b:>{w}}" for b in layouts))
        for a in layouts:
            marks = ["-" if (a, b) not in cell else ("ok" if cell[(a, b)]["ok"] else "FAIL") for b in layouts]
            print(f"{a:>{w}}" + "".join(f"{m:>{w}}" for m in marks))
        worst_loss = max(r["max_loss_rel_diff"] for r in mine)
        print(
            f"  {len(mine)} pairs, {sum(r['ok'] for r in mine)} ok; state entries per checkpoint "
            f"{min(r['entries'] for r in mine)}-{max(r['entries'] for r in mine)}, largest |state difference| "
            f"{max(r['max_state_abs_diff'] for r in mine):.3g}, largest loss difference {worst_loss:.2e} (relative)"
        )
        for r in mine:
            if not r["ok"]:
                print(
                    f"  FAIL {r['source']} -> {r['target']}: keys {r['keys_differ']} unequal {r['unequal']} "
                    f"loss {r['max_loss_rel_diff']:.2e}"
                )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out", help="folder for plans, checkpoints and metrics (default: a temporary one)")
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--ring", action="store_true", help="each layout resumed by the next one only (the test's pairs)")
    ap.add_argument("--show", help="print the matrices of records a --json run wrote, run nothing")
    args = ap.parse_args(argv)
    if args.show:
        rows = json.loads(Path(args.show).read_text())
        print_matrix(rows)
        return 0 if all(r["ok"] for r in rows) else 1
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(args.models.split(","), Path(args.out or tmp), ring=args.ring)
    print_matrix(rows)
    print(f"\n{len(rows)} pairs in {time.perf_counter() - start:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
