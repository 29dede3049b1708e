"""The plan file the search writes: every field filled, load == saved, validate() against world sizes."""

from __future__ import annotations

import json

import pytest

from planner.cli.common import PROFILES_DIR, resolve_cluster_path
from planner.cli.main import main
from planner.core import StratagemError
from planner.plan import TrainingSettings, load_plan, save_plan, validate
from planner.profile import load_cluster_profile, load_model_profile
from planner.search import SearchConfig, build_plan, plan_search, stage_ranks

TINY = PROFILES_DIR / "models" / "gpt-tiny.json"


@pytest.fixture(scope="module")
def tiny_plan():
    profile = load_model_profile(TINY)
    cluster = load_cluster_profile(resolve_cluster_path("local-cpu-2core"))
    result = plan_search(profile, cluster, gpus=2, global_batch=8, config=SearchConfig(top_k=3))
    training = TrainingSettings(global_batch=8, seq_len=profile.seq_len, dtype=profile.dtype)
    return build_plan(result, model=profile.model, profile=profile, cluster=cluster, training=training), result


def test_stage_ranks_row_major():
    # mesh (pp=2, dp=2, tp=2): pp rank 1 holds global ranks 4..7, tp pairs contiguous
    assert stage_ranks(1, dp=2, tp=2) == [4, 5, 6, 7]
    assert stage_ranks(0, dp=3, tp=1) == [0, 1, 2]


def test_plan_fields_filled_and_valid(tiny_plan):
    plan, result = tiny_plan
    validate(plan, 2)
    assert plan.planner_version and plan.model_profile_hash and plan.cluster_hash
    assert plan.predictions.step_time_s == pytest.approx(result.best.step_s, rel=1e-12)
    assert plan.search.status == "optimal" and plan.search.gap == 0.0
    assert plan.search.candidates_solved >= 1
    assert len(plan.search.top_k) == len(result.ranked) - 1
    assert all(alt.slowdown >= 1.0 for alt in plan.search.top_k)
    paths = [p for st in plan.stages for p in st.module_paths]
    assert paths == [layer.path for layer in load_model_profile(TINY).layers]
    assert set(plan.layout) == set(paths)
    assert len(plan.predictions.stages) == len(plan.stages)


def test_round_trip(tiny_plan, tmp_path):
    plan, _ = tiny_plan
    path = save_plan(plan, tmp_path / "plan.json")
    loaded = load_plan(path)
    assert loaded.model_dump(exclude={"content_hash"}) == plan.model_dump(exclude={"content_hash"})
    assert loaded.content_hash and loaded.content_hash.startswith("sha256:")


def test_validate_rejects_wrong_world_size(tiny_plan):
    plan, _ = tiny_plan
    with pytest.raises(StratagemError, match="plan needs 2 ranks but the launch has 4"):
        validate(plan, 4)


def test_cli_plan_on_cpu_writes_a_valid_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(
        [
            "plan",
            "--model",
            "gpt:tiny",
            "--model-profile",
            str(TINY),
            "--cluster",
            "local-cpu-2core",
            "--gpus",
            "2",
            "--global-batch",
            "8",
            "--seq",
            "64",
            "--top-k",
            "2",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    plan = load_plan(out)
    validate(plan, 2)
    assert "predicted step time" in capsys.readouterr().out
    assert json.loads(out.read_text())["schema_version"] == 3


def test_no_plan_fits_names_the_shortfall(tmp_path, capsys):
    code = main(
        [
            "plan",
            "--model",
            "gpt:tiny",
            "--model-profile",
            str(TINY),
            "--cluster",
            "local-cpu-2core",
            "--gpus",
            "2",
            "--global-batch",
            "8",
            "--memory-fraction",
            "0.000001",
            "--out",
            str(tmp_path / "p.json"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "no plan fits in memory" in err and "bytes) short" in err and "more GPUs" in err


def test_a_stopped_search_is_reported_as_not_optimal(tmp_path, capsys, monkeypatch):
    """A CBC run stopped by its time limit without a bound of its own stays 'time_limit' in the plan file;
    its gap comes from the search's own lower bound of that candidate (finite, > 0, <= 1); the plan loads
    back and the terminal says it is not optimal."""
    import math
    from dataclasses import replace

    import planner.search.planner as search_planner

    real_solve = search_planner.solve

    def stopped(problem, config, **kwargs):
        return replace(real_solve(problem, config, **kwargs), status="time_limit", gap=math.inf, bound_s=-math.inf)

    monkeypatch.setattr(search_planner, "solve", stopped)
    out = tmp_path / "plan.json"
    code = main(
        [
            "plan",
            "--model",
            "gpt:tiny",
            "--model-profile",
            str(TINY),
            "--cluster",
            "local-cpu-2core",
            "--gpus",
            "2",
            "--global-batch",
            "8",
            "--seq",
            "64",
            "--top-k",
            "1",
            "--time-limit",
            "1",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    plan = load_plan(out)
    assert plan.search.status == "time_limit" and 0.0 < plan.search.gap <= 1.0
    assert "NOT proven optimal (time_limit)" in plan.search.notes
    assert "not proven optimal" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("command", ["plan", "launch"])
def test_every_flag_has_help_and_no_none_default_noise(command):
    from planner.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    parser = sub.choices[command]
    text = parser.format_help()
    missing = [a.option_strings or a.dest for a in parser._actions if not a.help]
    assert not missing, f"flags without help: {missing}"
    assert "(default: None)" not in text and "(default: False)" not in text and "``" not in text


def test_older_plans_are_migrated_to_integer_counts_without_num_micro_batches(tmp_path):
    """Schema 3 keeps only the per-replica micro-batch counts. A version-2 file (counts and the overloaded
    ``schedule.num_micro_batches``) and a version-1 file (no counts) load as the same plan, each checked
    against its own hash first; a tampered old file is refused."""
    import json

    from fixtures.plans import make_plan
    from planner.core import StratagemError, content_hash
    from planner.model import parse_model
    from planner.plan import PLAN_SCHEMA_VERSION, load_plan, save_plan

    plan = make_plan(parse_model("gpt:tiny"), dp=2, global_batch=16, batch_shares=[0.75, 0.25])
    assert PLAN_SCHEMA_VERSION == 3 and plan.schedule.micro_batches_per_replica == [3, 1]
    path = save_plan(plan, tmp_path / "v3.json")
    saved = json.loads(path.read_text())
    assert saved["schedule"]["micro_batches_per_replica"] == [3, 1] and "num_micro_batches" not in saved["schedule"]
    assert all(isinstance(m, int) for m in saved["schedule"]["micro_batches_per_replica"])
    assert plan.schedule.max_micro_batches == 3

    v2 = {**saved, "schema_version": 2}
    v2["schedule"] = {**saved["schedule"], "num_micro_batches": 3}
    v2["content_hash"] = content_hash(v2)
    v1 = {**v2, "schema_version": 1}
    v1["schedule"] = {k: v for k, v in v2["schedule"].items() if k != "micro_batches_per_replica"}
    v1["content_hash"] = content_hash(v1)
    for name, old in (("v2", v2), ("v1", v1)):
        (tmp_path / f"{name}.json").write_text(json.dumps(old))
        migrated = load_plan(tmp_path / f"{name}.json")
        assert migrated.schema_version == 3 and migrated.schedule.micro_batches_per_replica == [3, 1]
        assert migrated.model_dump(exclude={"content_hash"}) == plan.model_dump(exclude={"content_hash"})

        old["training"] = {**old["training"], "lr": 0.5}  # edited after writing: its hash no longer matches
        (tmp_path / f"{name}-edited.json").write_text(json.dumps(old))
        with pytest.raises(StratagemError, match="content_hash mismatch"):
            load_plan(tmp_path / f"{name}-edited.json")


def test_stored_micro_batch_counts_must_match_the_split(tmp_path):
    import json

    from fixtures.plans import make_plan
    from planner.core import StratagemError
    from planner.model import parse_model
    from planner.plan import load_plan, save_plan

    data = json.loads(save_plan(make_plan(parse_model("gpt:tiny"), dp=2), tmp_path / "p.json").read_text())
    data["schedule"]["micro_batches_per_replica"] = [2, 1]
    data["content_hash"] = None
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(StratagemError, match="micro_batches_per_replica"):
        load_plan(tmp_path / "bad.json")


def test_no_plan_names_the_candidates_that_could_not_be_priced(tmp_path, capsys):
    """Four localhost "nodes" with no inter-node link fits: no plan for 8 devices, and the error names the missing
    fit (not a memory shortfall, which it is not)."""
    cluster = json.loads((PROFILES_DIR / "hardware/local-cpu-2core.json").read_text())
    cluster["nodes"][0]["count"], cluster["name"] = 4, "local-cpu-4x2"
    cluster.pop("content_hash", None)
    (tmp_path / "cluster.json").write_text(json.dumps(cluster))
    argv = ["plan", "--model", "gpt:tiny", "--cluster", str(tmp_path / "cluster.json"), "--gpus", "8"]
    assert main([*argv, "--global-batch", "8", "--seq", "16", "--dtype", "fp32", "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "could not be priced" in err and "no collective fit for all_reduce" in err, err
    assert not (tmp_path / "p").exists()
