"""Fuzzing the CLI (issue 12): generated bad inputs give one `error:` line and exit 2, never a traceback, a
hang, exit 0 on garbage, or a replaced file. ``benchmarks/fuzz_cli.py`` runs the larger set and prints totals."""

from __future__ import annotations

import logging

import fuzz_harness as fz
import pytest


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return fz.build_workdir(tmp_path_factory.mktemp("fuzz"))


@pytest.fixture(scope="module")
def outcomes(workdir):
    logging.disable(logging.WARNING)  # resize notes etc. on stderr are not findings
    try:
        cases = fz.all_cases(workdir, mutations_per_document=25, hypothesis_examples=40, seed=12)
        return fz.run_all(cases, workdir, timeout_s=20)
    finally:
        logging.disable(logging.NOTSET)


def test_at_least_300_cases_ran(outcomes):
    classes = {o.case.klass for o in outcomes}
    assert len(outcomes) >= 300
    assert classes == {"numeric-flag", "plan-claims", "path", "input-bytes", "mutation", "hypothesis"}


@pytest.mark.parametrize("klass", ["numeric-flag", "plan-claims", "path", "input-bytes", "mutation", "hypothesis"])
def test_no_findings(outcomes, klass):
    bad = [
        f"{o.kind}: {o.case.command} {o.case.note}: {o.detail}" for o in fz.failures(outcomes) if o.case.klass == klass
    ]
    assert bad == [], "\n".join(bad[:20])


def test_the_harness_sees_what_it_must(workdir):
    """The checks themselves can fail: a replaced FIFO, exit 0 and a traceback are each reported."""
    import os

    garbage = fz.Case("show", "path", ("show", workdir["plan"]), "error", "a valid plan called garbage")
    assert fz.run_case(garbage, workdir).kind == "exit0-on-garbage"
    valid = fz.Case("show", "path", ("show", workdir["plan"]), "ok", "valid")
    assert fz.run_case(valid, workdir).kind == "ok"
    broken = fz.Case("show", "path", ("show", workdir["plan"], "--png", workdir["fifo"]), "error", "png into a FIFO")
    assert fz.run_case(broken, workdir).kind == "error"
    before = fz.snapshot(workdir)
    os.unlink(workdir.files["fifo"])
    workdir.files["fifo"].write_text("replaced")
    try:
        assert fz.snapshot(workdir) != before
    finally:
        workdir.files["fifo"].unlink()
        os.mkfifo(workdir.files["fifo"])
