"""`plan --gap g`: a search stopped at a relative gap claims optimality only when its bound proves it."""

from __future__ import annotations

import json

import pytest

from planner.cli.main import main

ARGS = ["plan", "--model", "gpt:gpt2-medium", "--cluster", "dgx-h100", "--gpus", "16", "--global-batch", "64"]


@pytest.mark.parametrize("gap", ["0.5", "0"])
def test_a_gap_plan_claims_optimality_only_when_proven(tmp_path, gap, capsys):
    out = tmp_path / "plan.json"
    assert main([*ARGS, "--seq", "1024", "--gap", gap, "--out", str(out)]) == 0
    search = json.loads(out.read_text())["search"]
    notes = search["notes"] if isinstance(search["notes"], str) else " ".join(search["notes"])
    if search["status"] == "optimal":
        assert search["gap"] == 0.0 and "proven optimal under the cost model" in notes
        assert all(alt["proven_optimal"] for alt in search["top_k"][:1])
    else:
        assert search["status"] == "within_gap" and 0 < search["gap"] <= float(gap)
        assert "NOT proven optimal (within_gap)" in notes
        assert "plan with --gap 0 to prove it" in capsys.readouterr().out.replace("\n", " ")
    if gap == "0":
        assert search["status"] == "optimal"


def test_candidates_the_cost_model_cannot_price_are_listed_and_qualify_the_claim(tmp_path, monkeypatch):
    from planner.core import StratagemError
    from planner.search import CandidateCosts

    original = CandidateCosts.quick_bound_s

    def refuse_tp2(self, outer, **kwargs):
        if outer.tp == 2:
            raise StratagemError("no collective fit for a 2-rank group (test)")
        return original(self, outer, **kwargs)

    monkeypatch.setattr(CandidateCosts, "quick_bound_s", refuse_tp2)
    out = tmp_path / "plan.json"
    assert main([*ARGS, "--seq", "1024", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    notes = doc["search"]["notes"]
    assert "over the candidates searched" in notes and "dropped unsearched" in notes
    assert "no collective fit for a 2-rank group (test) (" in notes and " tp2 " in f" {notes} "
    assert doc["mesh"]["sizes"][doc["mesh"]["axes"].index("tp")] != 2
