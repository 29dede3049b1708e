"""`stratagem estimate`: JSON for GPT presets on every shipped cluster (mixed included), errors exit 2."""

import json

import pytest

from planner.cli.main import main

KEYS = {"step_time_s", "tokens_per_s", "model_tflops_per_gpu", "hardware_tflops_per_gpu", "mfu", "peak_mem_bytes",
        "per_rank", "breakdown"}


def _run(capsys, *argv):
    status = main(["estimate", *argv])
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.mark.parametrize("cluster,model,degrees", [
    ("dgx-a100-80g", "gpt:gpt3-175b", ["--tp", "8", "--pp", "16", "--dp", "8", "--gpus", "1024"]),
    ("dgx-h100", "gpt:megatron-h100-7.1b", ["--tp", "2", "--dp", "4", "--gpus", "8"]),
    ("dgx-h200", "llama:llama2-7b", ["--tp", "1", "--dp", "8"]),
    ("aws-p3-16xlarge", "gpt:gpt2-medium", ["--tp", "2", "--pp", "2", "--dp", "4"]),
    ("ibm-minsky", "gpt:gpt2", ["--tp", "1", "--dp", "8"]),
    ("mixed-a100-v100", "gpt:megatron-1.7b", ["--tp", "8", "--pp", "4", "--gpus", "32"]),
])
def test_json_on_each_shipped_cluster(capsys, cluster, model, degrees):
    status, out, err = _run(capsys, "--model", model, "--cluster", cluster, "--global-batch", "64",
                            "--micro-batch", "1", "--recompute", "selective", *degrees, "--json")
    assert status == 0, err
    doc = json.loads(out)
    assert KEYS <= doc.keys()
    assert doc["step_time_s"] > 0 and 0 < doc["mfu"] < 1 and doc["peak_mem_bytes"] > 0
    if cluster == "mixed-a100-v100":
        by_type = {r["node_type"]: r["microbatch_s"] for r in doc["per_rank"]}
        assert set(by_type) == {"dgx-a100-80g", "p3.16xlarge"}
        assert by_type["p3.16xlarge"] > by_type["dgx-a100-80g"]  # the same layers run slower on V100


def test_brief_example_and_table_output(capsys):
    status, out, err = _run(capsys, "--model", "gpt", "--layers", "96", "--hidden", "12288", "--heads", "96",
                            "--seq", "2048", "--vocab", "51200", "--cluster", "dgx-a100-80g", "--gpus", "1024",
                            "--global-batch", "1536", "--micro-batch", "1", "--tp", "8", "--pp", "16", "--dp", "8",
                            "--schedule", "interleaved", "--virtual-stages", "2", "--zero", "1",
                            "--recompute", "selective", "--sequence-parallel")
    assert status == 0, err
    assert "step time" in out and "MFU" in out


@pytest.mark.parametrize("argv,needle", [
    (["--tp", "8", "--pp", "2", "--dp", "2", "--gpus", "64"], "--gpus is 64"),
    (["--tp", "5", "--gpus", "5"], "not divisible by tp=5"),
    (["--tp", "8", "--pp", "128", "--dp", "1"], "chunks"),
    (["--dp", "3"], "not a multiple"),
])
def test_bad_configurations_exit_2_with_the_fix(capsys, argv, needle):
    status, _, err = _run(capsys, "--model", "gpt:gpt3-175b", "--cluster", "dgx-a100-80g", "--global-batch", "64",
                          *argv)
    assert status == 2
    assert needle in err and err.startswith("error:")
