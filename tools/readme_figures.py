"""Regenerate the README's figure blocks from the benchmarks' own output (none typed by hand).

    python tools/readme_figures.py          # rewrite the blocks in README.md (atomically)
    python tools/readme_figures.py --check  # exit 1, naming the blocks, when README.md differs (tests run this)

A block sits between ``<!-- figures: NAME -->`` and ``<!-- /figures: NAME -->`` lines; everything between
them is replaced by what :data:`BLOCKS` computes, with no GPU and no launch (seconds):

- ``cost-accuracy``: ``benchmarks/cost_accuracy.py`` — held-out rows first, in-sample rows apart;
- ``long-context``: ``benchmarks/long_context_accuracy.py``;
- ``moe-validation``: ``benchmarks/moe_validation.py``'s counted table (each dropless row at its router's fit);
- ``gpu-speed``: ``benchmarks/gpu_speed.py --from-data benchmarks/data/h200`` (stored runs, predictions
  recomputed);
- ``frontier``: ``benchmarks/frontier.py``'s stored run (``benchmarks/data/frontier``: table and timing);
- ``sc21-compare``: ``benchmarks/compare_to_published.py`` (one exact search per SC21 Table 1 row, ~15 s).

Figures that need launches (the CPU runtime's ratios) are not in blocks; their benchmarks print them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def frontier() -> str:
    import frontier as fr

    from planner.frontier import FrontierRow, mark_pareto, terminal_lines

    rows, record = fr.stored()
    typed = []
    for r in rows:
        kw = {}
        for name, value in r.items():
            field = FrontierRow.__dataclass_fields__[name]
            if value == "":
                kw[name] = None if name not in ("reason", "strategy", "search", "plan_command") else ""
            elif field.type in ("int",):
                kw[name] = int(value)
            elif field.type in ("bool",):
                kw[name] = value == "True"
            elif "float" in str(field.type):
                kw[name] = float(value)
            else:
                kw[name] = value
        typed.append(FrontierRow(**kw))
    table = "\n".join(terminal_lines(mark_pareto(typed)))
    chosen = next((line for line in record["stdout"].splitlines() if "configuration" in line), "")
    return (
        f"`{record['command']}` (`benchmarks/frontier.py`, stored in `benchmarks/data/frontier/`): "
        f"{len(rows)} exact plan searches in {record['frontier_s']} s on {record['cpu_cores']} CPU cores "
        f"({record['date']}). C / E: Pareto-optimal in (days, cost) / (days, energy); costs at the profiles' "
        "on-demand list prices.\n\n```\n" + table + "\n" + chosen + "\n```\n\n"
        "![frontier](benchmarks/data/frontier/llama3-70b.png)"
    )


def cost_accuracy() -> str:
    import cost_accuracy as ca

    out = ca.run(ca.DEFAULT_CSV)
    s = out["summary"]
    groups: dict[str, list[float]] = {}
    for r in out["cases"]:
        if r["role"] != "reference":
            groups.setdefault(f"{r['group']} ({r['role']})", []).append(abs(r["error"]))
    per_group = "; ".join(f"{g} {_pct(statistics.fmean(e))}" for g, e in sorted(groups.items()))
    return (
        f"`benchmarks/cost_accuracy.py` predicts {s['n_all']} published training runs (Megatron-LM SC21 Tables "
        "1-2, Korthikanti et al. 2022, the Megatron-LM README tables of 2020, 2021 and H100, torchtitan's FSDP2 "
        "Llama runs on A100; every row and its source in `benchmarks/data/published_cases.csv`) from their "
        "configurations alone, with the shipped cluster profiles. **Held out** — the "
        f"{s['n_validate']} rows that neither fitted a constant nor chose a modelling mechanism — the mean "
        f"|error| is {_pct(s['mean_abs_error'])}, the largest {_pct(s['max_abs_error'])}. In-sample, and no "
        f"headline: {s['n_calib']} rows fitted kernel-model constants ({_pct(s['mean_abs_error_calib'])}) and "
        f"{s['n_chose']} rows chose a mechanism ({_pct(s['mean_abs_error_chose'])}): SC21 Table 2's DeepSpeed "
        "ZeRO-3 switches and fabric load, the fabric load's scope on Korthikanti's rows, the overlap contention "
        "on torchtitan's. By source and role: "
        f"{per_group}. The benchmark prints every row with its role and why; a test pins each row's role."
    )


def long_context() -> str:
    import long_context_accuracy as lc

    res = lc.run()
    held = [r for r in res["cases"] if r["role"] == "validate"]
    fitted = [r for r in res["cases"] if r["role"] == "calib"]
    return (
        "`benchmarks/long_context_accuracy.py` checks it against published long-context runs (NeMo's Llama-2-7B "
        "CP table on H100 at 4k-1024k tokens and Llama 3 405B at 131,072 tokens on 16,384 H100): held out, "
        f"{len(held)} rows, mean |error| {_pct(res['mean_abs_error_validate'])}, max "
        f"{_pct(res['max_abs_error_validate'])}; {len(fitted)} rows each fitted one constant (in-sample)."
    )


def moe_validation() -> str:
    import moe_validation as mv

    rows = mv.load_rows()
    fits = mv.router_fits(rows)
    lines = [
        "| run (`benchmarks/data/moe_runs.csv`) | layout | dispatcher | routing | imbalance | published step | "
        "predicted | error | role |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row, published, step, err in mv.table(rows, fits):
        if row["status"] == "reference":
            continue
        lam = fits.get(row["imbalance_from"] or row["run"], 1.0) if row["routing"] == "dropless" else 1.0
        layout = f"tp{row['tp']} pp{row['pp']} dp{row['dp']} ep{row['ep']} v{row['virtual_stages']}"
        role = "held out" if row["status"] == "validate" else "fitted its router's imbalance"
        lines.append(
            f"| {row['run']} | {layout} | {row['dispatcher']} | {row['routing']} | {lam:.3f} | {published:.2f} s | "
            f"{step:.2f} s | {100 * err:+.0f} % | {role} |"
        )
    s = mv.held_out_summary(rows, fits)
    n_ref = sum(1 for r in rows if r["status"] == "reference")
    lines += [
        "",
        f"Held out: {s['within']} of the {s['n']} counted rows within {mv.TOLERANCE:.0%}, mean |error| "
        f"{_pct(s['mean'])}, max {_pct(s['max'])}. {n_ref} reference rows (what the cost model does not "
        "represent, or hardware no shipped profile describes) are printed by the benchmark, not counted.",
    ]
    return "\n".join(lines)


def gpu_speed() -> str:
    import gpu_speed as gs

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        gs.print_table(gs.from_data(REPO / "benchmarks" / "data" / "h200", None))
    return f"```\n{buf.getvalue()}```"


def sc21_compare() -> str:
    import compare_to_published as cp

    cluster, search = cp.dgx_a100(), cp.default_search()
    rows = [cp.compare_row(case, cluster, search) for case in cp.table_1_cases(cp.DEFAULT_CSV)]
    errors = [r["record"].current_step_time_s / r["case"].published_s - 1 for r in rows]
    proven = sum(r["result"].status == "optimal" for r in rows)
    lines = [
        f"`benchmarks/compare_to_published.py` runs `--compare-to` on every SC21 Table 1 row ({len(rows)} rows; "
        f"{proven} of {len(rows)} searches proven optimal). Every step time is the cost model's, except the "
        "measured column (the paper's TFLOP/s, SC21 eq. 3), which the cost model predicts within "
        f"{100 * min(errors):+.0f} % to {100 * max(errors):+.0f} % on these rows — in-sample: the kernel-model "
        "constants were fitted on SC21 Table 1 (`benchmarks/cost_accuracy.py`).",
        "",
        "| SC21 Table 1 | published (tp, pp, dp, mb) | measured | model: published | plan | plan as Megatron args "
        "| predicted speed-up |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        case, rec = r["case"], r["record"]
        c = case.config
        layout = f"{c.tp}, {c.pp}, {c.dp}, {c.micro_batch}" + (
            f" (v {c.virtual_stages})" if c.virtual_stages > 1 else ""
        )
        lines.append(
            f"| {case.label.split()[1]}, {case.gpus} GPUs | {layout} | {case.published_s:.2f} s | "
            f"{rec.current_step_time_s:.2f} s | {rec.plan_step_time_s:.2f} s | {rec.exported_step_time_s:.2f} s | "
            f"{rec.speedup:.2f}x |"
        )
    lost = max(rows, key=lambda r: r["record"].exported_step_time_s / r["record"].plan_step_time_s)
    rec = lost["record"]
    lines += [
        "",
        f"The plan that loses most as Megatron arguments is {lost['case'].label.split()[1]}'s: it leans on "
        "per-layer choices Megatron cannot state, and its nearest Megatron arguments keep "
        f"{rec.speedup:.2f}x of the plan's {rec.current_step_time_s / rec.plan_step_time_s:.2f}x.",
    ]
    return "\n".join(lines)


BLOCKS = {
    "cost-accuracy": cost_accuracy,
    "long-context": long_context,
    "moe-validation": moe_validation,
    "gpu-speed": gpu_speed,
    "sc21-compare": sc21_compare,
    "frontier": frontier,
}


def regenerate(text: str, names: list[str] | None = None) -> tuple[str, list[str]]:
    """(README text with every block (or those in ``names``) regenerated, names of the blocks that changed); a
    one-line error when a block's markers are missing."""
    changed = []
    for name, make in BLOCKS.items():
        if names is not None and name not in names:
            continue
        pattern = re.compile(rf"(<!-- figures: {name} -->\n)(.*?)(<!-- /figures: {name} -->)", flags=re.S)
        match = pattern.search(text)
        if match is None:
            raise SystemExit(f"error: README.md has no '<!-- figures: {name} -->' block; add its markers")
        body = make().rstrip("\n") + "\n"
        if match.group(2) != body:
            changed.append(name)
            text = text[: match.start(2)] + body + text[match.end(2) :]
    return text, changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when README.md's blocks are not the output")
    args = p.parse_args(argv)
    import logging

    logging.disable(logging.WARNING)
    with contextlib.redirect_stderr(io.StringIO()):
        text, changed = regenerate(README.read_text(encoding="utf-8"))
    if args.check:
        if changed:
            print(f"README.md figure blocks differ from the benchmarks: {', '.join(changed)}; run {__file__}")
            return 1
        return 0
    from planner.core import atomic_write_text

    atomic_write_text(README, text)
    print(f"regenerated: {', '.join(changed) or 'nothing changed'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
