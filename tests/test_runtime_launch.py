"""The launcher itself: two "nodes" on this machine meet through the c10d rendezvous, and a job that
runs past --timeout-s is stopped with a one-line error."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from runtime_helpers import REPO

from fixtures.plans import make_plan
from fixtures.reference import reference_losses
from planner.core import StratagemError
from planner.model import parse_model
from planner.plan import save_plan
from runtime.executor.metrics import final_step_losses, read_metrics
from runtime.launch import run_command


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def _two_node_launch(plan_path, tmp_path) -> tuple[list[int], list[str]]:
    endpoint = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for r in (0, 1):
        (tmp_path / f"m{r}.jsonl").unlink(missing_ok=True)
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "planner.cli.main",
                "launch",
                str(plan_path),
                "--steps",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                str(r),
                "--rdzv-endpoint",
                endpoint,
                "--timeout-s",
                "90",
                "--metrics",
                str(tmp_path / f"m{r}.jsonl"),
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        outputs = [n.communicate(timeout=120)[0] for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    return [n.returncode for n in nodes], outputs


def test_two_nodes_rendezvous_on_localhost(tmp_path):
    plan = make_plan(parse_model("gpt:tiny"), dp=2)
    plan_path = save_plan(plan, tmp_path / "plan.json")
    codes, outputs = _two_node_launch(plan_path, tmp_path)
    if codes != [0, 0] and "terminate called without an active exception" in "".join(outputs):
        # gloo's teardown on 2 torchrun agents sometimes aborts one rank after its last step (seen 1 run in
        # about 12 here, torch 2.13; cf. pytorch/pytorch#190489): one retry, any other failure is reported
        codes, outputs = _two_node_launch(plan_path, tmp_path)
    assert codes == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    written = [p for p in (tmp_path / "m0.jsonl", tmp_path / "m1.jsonl") if p.exists()]
    assert len(written) == 1  # only the node holding global rank 0 writes metrics
    losses = final_step_losses(read_metrics(written[0]))
    assert [losses[1], losses[2]] == pytest.approx(reference_losses(plan, 2), rel=1e-5)


def test_a_job_past_its_timeout_is_stopped():
    with pytest.raises(StratagemError, match="ran past --timeout-s 0.5"):
        run_command([sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=0.5)
