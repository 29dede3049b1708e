"""Which of transformers' causal language models Stratagem trains as transformers computes them.

    .venv/bin/python benchmarks/hf_coverage.py [--only llama,olmo] [--plan]

Every model type whose config class transformers maps to an ``AutoModelForCausalLM`` (listed from transformers'
own ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, not by hand) is taken with its config's defaults and put through the
fidelity check (``runtime.models.fidelity``: a tiny instance built by transformers and by the wrapper the runtime
trains, same weights, fp32, logits compared). With ``--plan`` each model that passes is also profiled on the meta
device at its tiny size and planned for 2 CPU ranks (``local-cpu-2core``). Each row is ``ok`` with the largest
logit difference, or ``refused`` with the one-line reason; a traceback or a model that passes with a difference
above the tolerance would be a bug, and is counted apart. Launching each model on 2 ranks is not part of this
benchmark yet.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.errors import StratagemError  # noqa: E402
from planner.modelspec import ModelSpec, hf_dims  # noqa: E402


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
    from planner.profiles import load_cluster_profile
    from planner.search.config import SearchConfig
    from planner.search.planner import plan_search
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
    result = plan_search(profile, cluster, n_devices=2, global_batch=4, config=SearchConfig(time_limit_s=30))
    return result.best.outer.summary()


def run(types: list[str], with_plan: bool) -> list[dict]:
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
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    import transformers

    types = args.only.split(",") if args.only else causal_lm_types()
    print(f"transformers {transformers.__version__}: {len(types)} causal-LM model types")
    print(f"{'model_type':28s} {'status':9s} {'max|dl|':>8s} {'time':>6s}  detail")
    rows = run(types, args.plan)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "refused", "TRACEBACK", "no-config", "no-tiny")}
    print(
        f"\n{counts['ok']} pass the fidelity check (max |logit difference| <= 1e-5), {counts['refused']} are refused "
        f"in one line, {counts['TRACEBACK']} tracebacks, {counts['no-config']} without a default config transformers "
        f"accepts, {counts['no-tiny']} whose shrunk config transformers rejects when rebuilt (--plan only); "
        f"{len(rows)} causal-LM model types"
    )
    return 1 if counts["TRACEBACK"] else 0


if __name__ == "__main__":
    sys.exit(main())
