"""`stratagem estimate`: JSON for GPT presets on every shipped cluster (mixed included), errors exit 2."""

import json

import pytest

from planner.cli.main import main
from planner.model import parse_model

KEYS = {
    "step_time_s",
    "tokens_per_s",
    "model_tflops_per_gpu",
    "hardware_tflops_per_gpu",
    "mfu",
    "peak_memory_bytes",
    "per_rank",
    "breakdown",
}


def _run(capsys, *argv):
    status = main(["estimate", *argv])
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.mark.parametrize(
    "cluster,model,degrees",
    [
        ("dgx-a100-80g", "gpt:gpt3-175b", ["--tp", "8", "--pp", "16", "--dp", "8", "--gpus", "1024"]),
        ("dgx-h100", "gpt:megatron-h100-7.1b", ["--tp", "2", "--dp", "4", "--gpus", "8"]),
        ("dgx-h200", "llama:llama2-7b", ["--tp", "1", "--dp", "8"]),
        ("dgx-h200", "gpt:gpt2-large", ["--tp", "4", "--dp", "2"]),
        ("local-cpu-2core", "gpt:tiny", ["--tp", "1", "--dp", "2"]),
        ("aws-p3-16xlarge", "gpt:gpt2-medium", ["--tp", "2", "--pp", "2", "--dp", "4"]),
        ("ibm-minsky", "gpt:gpt2", ["--tp", "1", "--dp", "8"]),
        ("mixed-a100-v100", "gpt:megatron-1.7b", ["--tp", "8", "--pp", "4", "--gpus", "32"]),
    ],
)
def test_json_on_each_shipped_cluster(capsys, cluster, model, degrees):
    status, out, err = _run(
        capsys,
        "--model",
        model,
        "--cluster",
        cluster,
        "--global-batch",
        "64",
        "--micro-batch",
        "1",
        "--recompute",
        "selective",
        *degrees,
        "--json",
    )
    assert status == 0, err
    doc = json.loads(out)
    assert KEYS <= doc.keys()
    assert doc["step_time_s"] > 0 and 0 < doc["mfu"] < 1 and doc["peak_memory_bytes"] > 0
    seq = parse_model(model).dims["max_seq"]
    assert doc["tokens_per_s"] == pytest.approx(64 * seq / doc["step_time_s"], rel=1e-9)
    assert doc["peak_memory_bytes"] == max(r["peak_memory_bytes"] for r in doc["per_rank"])
    assert doc["hardware_tflops_per_gpu"] >= doc["model_tflops_per_gpu"] > 0  # selective recompute adds FLOPs
    assert all(v >= 0 for v in doc["breakdown"].values()) and doc["breakdown"]["forward"] > 0
    if cluster == "mixed-a100-v100":
        by_type = {r["node_type"]: r["microbatch_s"] for r in doc["per_rank"]}
        assert set(by_type) == {"dgx-a100-80g", "p3.16xlarge"}
        assert by_type["p3.16xlarge"] > by_type["dgx-a100-80g"]  # the same layers run slower on V100


def test_brief_example_and_table_output(capsys):
    status, out, err = _run(
        capsys,
        "--model",
        "gpt",
        "--layers",
        "96",
        "--hidden",
        "12288",
        "--heads",
        "96",
        "--seq",
        "2048",
        "--vocab",
        "51200",
        "--cluster",
        "dgx-a100-80g",
        "--gpus",
        "1024",
        "--global-batch",
        "1536",
        "--micro-batch",
        "1",
        "--tp",
        "8",
        "--pp",
        "16",
        "--dp",
        "8",
        "--schedule",
        "interleaved",
        "--virtual-stages",
        "2",
        "--zero",
        "1",
        "--recompute",
        "selective",
        "--sequence-parallel",
    )
    assert status == 0, err
    assert "step time" in out and "MFU" in out


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--tp", "8", "--pp", "2", "--dp", "2", "--gpus", "64"], "--gpus is 64"),
        (["--tp", "5", "--gpus", "5"], "not divisible by tp=5"),
        (["--tp", "8", "--pp", "128", "--dp", "1"], "chunks"),
        (["--dp", "3"], "not a multiple"),
    ],
)
def test_bad_configurations_exit_2_with_the_fix(capsys, argv, needle):
    status, _, err = _run(
        capsys, "--model", "gpt:gpt3-175b", "--cluster", "dgx-a100-80g", "--global-batch", "64", *argv
    )
    assert status == 2
    assert needle in err and err.startswith("error:")


def _subparser(parser, *names):
    for name in names:
        sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        parser = sub.choices[name]
    return parser


@pytest.mark.parametrize(
    "command",
    [("profile", "model"), ("profile", "cluster"), ("profile", "check"), ("estimate",), ("show",)],
    ids=" ".join,
)
def test_every_flag_has_help_and_no_none_default_noise(command):
    from planner.cli.main import build_parser

    parser = _subparser(build_parser(), *command)
    text = parser.format_help()
    missing = [a.option_strings or a.dest for a in parser._actions if not a.help]
    assert not missing, f"flags without help: {missing}"
    assert "(default: None)" not in text and "(default: False)" not in text and "``" not in text
