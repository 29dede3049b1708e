"""Which of transformers' causal language models Stratagem trains as transformers computes them.

    .venv/bin/python benchmarks/hf_coverage.py [--only llama,olmo] [--plan] [--launch]

Every model type whose config class transformers maps to an ``AutoModelForCausalLM`` (listed from transformers'
own ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, not by hand) is taken with its config's defaults and put through the
fidelity check (``runtime.models.fidelity``: a tiny instance built by transformers and by the wrapper the runtime
trains, same weights, fp32, logits compared). With ``--plan`` each model that passes is also profiled on the meta
device at its tiny size and planned for 2 CPU ranks (``local-cpu-2core``). Each row is ``ok`` with the largest
logit difference, or ``refused`` with the one-line reason; a traceback or a model that passes with a difference
above the tolerance would be a bug, and is counted apart.

With ``--launch`` each passing model is also trained: its tiny instance (dropout off) is built by transformers
with seeded weights and saved with ``save_pretrained``; one ``torchrun`` of 2 CPU ranks per model runs one step of
DP2, PP2 (1F1B, 2 micro-batches) and, where the model's TP layout is derived, TP2, each started with
``--init-from`` that folder, and step 1's loss is compared with the loss transformers computes on the same batch
(within 1e-5). A model type that transformers saves in another layout than it trains in (``--init-from`` refuses
it) is launched from its random init and its layouts' losses are compared with each other.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.core import StratagemError  # noqa: E402
from planner.model import ModelSpec, hf_dims  # noqa: E402


def causal_lm_types() -> list[str]:
    """Model types transformers builds with AutoModelForCausalLM (from its own mapping)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


class TinyConfigRejected(Exception):
    """transformers' validators reject the tiny config once rebuilt from its dict (per-layer lists the shrink
    does not know): the planning step of this benchmark cannot run, which says nothing of a user's config."""


def plan_tiny(spec: ModelSpec) -> str:
    """Profile the tiny instance on meta and plan it for 2 CPU ranks: the chosen layout."""
    from planner.cli.common import resolve_cluster_path
    from planner.profile import load_cluster_profile
    from planner.search import SearchConfig, plan_search
    from runtime.models.fidelity import tiny_config
    from runtime.models.hf import hf_config
    from runtime.profiling.model import profile_model_analytic

    tiny = tiny_config(hf_config(spec)).to_dict()
    small = spec.model_copy(update={"config": tiny, "dims": hf_dims(tiny)})
    try:
        hf_config(small)
    except Exception as exc:  # noqa: BLE001 - the benchmark's own shrunk config, not a user's
        raise TinyConfigRejected(type(exc).__name__) from None
    profile = profile_model_analytic(small, seq_len=16, dtype="fp32", tp_degrees=(1,))
    cluster = load_cluster_profile(resolve_cluster_path("local-cpu-2core"))
    result = plan_search(profile, cluster, gpus=2, global_batch=4, config=SearchConfig(time_limit_s=30))
    return result.best.outer.summary()


DROPOUT_KEYS = (
    "dropout", "attention_dropout", "hidden_dropout", "activation_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
    "hidden_dropout_prob", "attention_probs_dropout_prob", "embedding_dropout", "ffn_dropout", "mlp_dropout",
    "residual_dropout", "emb_pdrop", "summary_first_dropout", "classifier_dropout", "layerdrop", "router_jitter_noise",
    "input_jitter_noise",
)  # fmt: skip
LAUNCH_TOL = 1e-5


def launch_tiny(spec: ModelSpec, root: Path) -> str:
    """Save the tiny model, launch its DP2 / PP2 / TP2 plans from it in one torchrun; a one-line result."""
    import os
    import subprocess

    import torch
    import transformers

    from fixtures.plans import make_plan
    from planner.model import parse_model
    from planner.plan import save_plan
    from runtime.executor.data import build_data_source
    from runtime.executor.metrics import final_step_losses, read_metrics
    from runtime.executor.pretrained import check_init_from
    from runtime.models import check_tp, is_splittable, layer_paths, loss_fn
    from runtime.models.external import external
    from runtime.models.fidelity import tiny_config
    from runtime.models.hf import experts_kwargs, hf_config

    tiny = tiny_config(hf_config(spec))
    for key in DROPOUT_KEYS:
        if isinstance(getattr(tiny, key, None), float):
            setattr(tiny, key, 0.0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny, dtype=torch.float32, **experts_kwargs(tiny)).eval()
    folder = root / (spec.config or {}).get("model_type", "model")
    model.save_pretrained(folder)
    local = parse_model("hf:" + str(folder / "config.json"))
    layouts: dict[str, dict] = {"dp2": dict(dp=2), "pp2": dict(pp=2, schedule="1f1b", num_micro_batches=2)}
    split = []
    for path in layer_paths(local):
        if is_splittable(local, path):
            try:
                check_tp(local, path, 2)
                split.append(path)
            except StratagemError:
                pass
    if split and not external(local).tp_note:
        layouts["tp2"] = dict(tp=2, split=split)
    args, plans, refused = ["--steps", "1", "--timeout-s", "120"], {}, ""
    for name, cfg in layouts.items():
        plan = make_plan(local, global_batch=4, seq_len=16, **cfg)
        try:
            check_init_from(folder, plan)
        except StratagemError as exc:
            refused = str(exc).split(": ", 1)[-1][:90]
        plans[name] = plan
        args += ["--plan", str(save_plan(plan, folder / f"{name}.json")), "--metrics", str(folder / f"{name}.jsonl")]
    if not refused:
        args += ["--init-from", str(folder)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    try:
        proc = subprocess.run(
            [*cmd, "-m", "runtime.executor.train", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired:
        return "LAUNCH FAILED: no result in 300 s"
    if proc.returncode != 0:
        lines = (proc.stdout + proc.stderr).splitlines()
        # a rank's own error before torchrun's ChildFailedError summary
        errors = [ln for ln in lines if ln.startswith("[rank") and ("Error" in ln or "error:" in ln)] or [
            ln for ln in lines if "Error" in ln or "error:" in ln
        ]
        return f"LAUNCH FAILED: {(errors[-1] if errors else proc.stderr[-150:]).strip()[:200]}"
    losses = {n: final_step_losses(read_metrics(folder / f"{n}.jsonl"))[1] for n in plans}
    if refused:
        spread = max(losses.values()) - min(losses.values())
        ok = "ran" if spread <= LAUNCH_TOL else "LOSSES DIFFER"
        return f"{ok} {'/'.join(plans)} from random init (layouts' losses within {spread:.1e}; --init-from: {refused})"
    seed = plans["dp2"].training.seed
    batch = build_data_source(local, "synthetic", global_batch=4, seq_len=16, seed=seed)(1)
    with torch.no_grad():
        reference = float(loss_fn(local)(model(input_ids=batch.inputs).logits, batch.targets))
    worst = max(abs(v - reference) for v in losses.values())
    ok = "ran" if worst <= LAUNCH_TOL else "LOSS DIFFERS"
    return f"{ok} {'/'.join(plans)} --init-from, step-1 loss vs transformers' max |diff| {worst:.1e}"


def run(types: list[str], with_plan: bool, launch_root: Path | None = None) -> list[dict]:
    import transformers

    from runtime.models.fidelity import check_hf_fidelity

    rows = []
    for model_type in types:
        start = time.perf_counter()
        row = {"model_type": model_type, "status": "", "diff": None, "detail": ""}
        try:
            config = transformers.AutoConfig.for_model(model_type)
        except Exception as exc:  # noqa: BLE001 - transformers' own default config does not validate
            row.update(status="no-config", detail=f"transformers' default config: {type(exc).__name__}")
            rows.append(row | {"seconds": time.perf_counter() - start})
            print(f"{model_type:28s} {row['status']:9s} {'':>8s} {'':>6s}  {row['detail']}", flush=True)
            continue
        try:
            raw = config.to_dict()
            spec = ModelSpec(family="hf", dims=hf_dims(raw), source=f"hf:{model_type}", config=raw)
            fidelity = check_hf_fidelity(spec)
            row.update(status="ok", diff=fidelity.max_abs_logit_diff)
            if with_plan:
                row["detail"] = plan_tiny(spec)
            if launch_root is not None:
                row["launch"] = launch_tiny(spec, launch_root)
                row["detail"] = (row["detail"] + "; " if row["detail"] else "") + row["launch"]
        except TinyConfigRejected as exc:
            row.update(status="no-tiny", detail=f"transformers rejects the shrunk config rebuilt from its dict: {exc}")
        except StratagemError as exc:
            row.update(status="refused", detail=str(exc).split(": ", 1)[-1])
        except Exception as exc:  # noqa: BLE001 - a traceback is what this benchmark counts
            row.update(status="TRACEBACK", detail=f"{type(exc).__name__}: {str(exc).splitlines()[0][:150]}")
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
        diff = "" if row["diff"] is None else f"{row['diff']:.1e}"
        line = f"{model_type:28s} {row['status']:9s} {diff:>8s} {row['seconds']:5.1f}s  {row['detail'][:150]}"
        print(line, flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help="model types, comma-separated (default: every causal LM)")
    parser.add_argument("--plan", action="store_true", help="also profile and plan each passing model (2 CPU ranks)")
    parser.add_argument(
        "--launch", action="store_true", help="also train each passing model one step under DP2, PP2 and TP2"
    )
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    import transformers

    types = args.only.split(",") if args.only else causal_lm_types()
    print(f"transformers {transformers.__version__}: {len(types)} causal-LM model types")
    print(f"{'model_type':28s} {'status':9s} {'max|dl|':>8s} {'time':>6s}  detail")
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(types, args.plan, Path(tmp) if args.launch else None)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "refused", "TRACEBACK", "no-config", "no-tiny")}
    print(
        f"\n{counts['ok']} pass the fidelity check (max |logit difference| <= 1e-5), {counts['refused']} are refused "
        f"in one line, {counts['TRACEBACK']} tracebacks, {counts['no-config']} without a default config transformers "
        f"accepts, {counts['no-tiny']} whose shrunk config transformers rejects when rebuilt (--plan only); "
        f"{len(rows)} causal-LM model types"
    )
    if args.launch:
        launched = [r.get("launch", "") for r in rows if r["status"] == "ok"]
        good = sum(x.startswith("ran") for x in launched)
        print(
            f"launched: {good} of {len(launched)} passing models trained one step under every layout with the "
            f"expected loss; {len(launched) - good} failed or differed (rows in capitals)"
        )
    return 1 if counts["TRACEBACK"] else 0


if __name__ == "__main__":
    sys.exit(main())
