"""Issue 12 regression tests: one per root cause found by fuzzing the CLI, and the rules that keep files safe.

Devices are never used as outputs here (the tests run as root): a FIFO, a socket and folders made under
tmp_path stand in for them.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
from pathlib import Path

import pytest

from planner.cli.main import main
from planner.core import StratagemError, atomic_write_text, check_output_path, read_json

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "profiles/models/gpt-tiny.json"
CLUSTER = REPO / "profiles/hardware/local-cpu-2core.json"


def _run(capsys, *argv: str) -> tuple[int, str]:
    status = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    return status, err


def _one_line_error(status: int, err: str, needle: str) -> None:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert status == 2 and len(lines) == 1 and needle in lines[0], err


PLAN = [
    "plan",
    "--model",
    "gpt:tiny",
    "--model-profile",
    str(MODEL),
    "--cluster",
    str(CLUSTER),
    "--gpus",
    "2",
    "--global-batch",
    "8",
]


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    assert main([*PLAN, "--out", str(out)]) == 0
    return out


def _mutated(plan_file: Path, tmp_path: Path, edit) -> Path:
    data = json.loads(plan_file.read_text())
    data["content_hash"] = None
    edit(data)
    out = tmp_path / "mutated.json"
    out.write_text(json.dumps(data))
    return out


# ---------------------------------------------------------------------------------------------------
# 1. Files are never destroyed
# ---------------------------------------------------------------------------------------------------


def _specials(tmp_path: Path) -> dict[str, Path]:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    sock = tmp_path / "sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock))
    s.close()
    folder = tmp_path / "folder"
    folder.mkdir()
    link = tmp_path / "link"
    link.symlink_to(fifo)
    return {"FIFO": fifo, "socket": sock, "folder": folder, "symlink to a FIFO": link}


def test_atomic_write_never_replaces_a_non_regular_file(tmp_path):
    for kind, path in _specials(tmp_path).items():
        mode = os.lstat(path).st_mode
        with pytest.raises(StratagemError, match="never replaced|not a regular file|names a folder"):
            atomic_write_text(path, "x")
        assert os.lstat(path).st_mode == mode, kind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "folder", "link", "sock"]  # no temp files left


@pytest.mark.parametrize("flag", ["--out"])
def test_plan_out_fifo_is_refused_before_the_search(tmp_path, capsys, flag):
    fifo = _specials(tmp_path)["FIFO"]
    status, err = _run(
        capsys, "plan", "--model", "gpt:tiny", "--cluster", CLUSTER, "--gpus", "2", "--global-batch", "8", flag, fifo
    )
    _one_line_error(status, err, "FIFO")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_output_equal_to_an_input_is_refused(tmp_path, capsys):
    model = Path(shutil.copy(MODEL, tmp_path / "m.json"))
    before = model.read_bytes()
    status, err = _run(
        capsys,
        "plan",
        "--model",
        "gpt:tiny",
        "--model-profile",
        model,
        "--cluster",
        CLUSTER,
        "--gpus",
        "2",
        "--global-batch",
        "8",
        "--out",
        tmp_path / "." / "m.json",
    )
    _one_line_error(status, err, "same file as the input --model-profile")
    assert model.read_bytes() == before


def test_show_html_equal_to_the_plan_is_refused(plan_file, capsys):
    before = plan_file.read_bytes()
    _one_line_error(*_run(capsys, "show", plan_file, "--html", plan_file), "same file as the input plan")
    assert plan_file.read_bytes() == before


@pytest.mark.parametrize("value,needle", [("", "empty"), ("   ", "empty"), ("dir/", "folder name")])
def test_empty_and_trailing_slash_outputs(tmp_path, capsys, value, needle):
    status, err = _run(
        capsys,
        "plan",
        "--model",
        "gpt:tiny",
        "--cluster",
        CLUSTER,
        "--gpus",
        "2",
        "--global-batch",
        "8",
        "--out",
        value if value != "dir/" else f"{tmp_path}/dir/",
    )
    _one_line_error(status, err, needle)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag", ["--html", "--png", "--metrics"])
def test_show_empty_strings_are_errors(plan_file, capsys, flag):
    _one_line_error(*_run(capsys, "show", plan_file, flag, ""), "empty")


def test_profile_cluster_empty_sizes_is_an_error(tmp_path, capsys):
    status, err = _run(
        capsys, "profile", "cluster", "--nproc-per-node", "2", "--sizes", "", "--out", tmp_path / "c.json"
    )
    _one_line_error(status, err, "message size")


def test_name_over_the_file_system_limit(tmp_path):
    with pytest.raises(StratagemError, match="longer than the file system allows"):
        check_output_path(tmp_path / ("x" * 300))


def test_written_files_have_normal_permissions(plan_file, tmp_path, capsys):
    umask = os.umask(0o022)
    try:
        assert main(["show", str(plan_file), "--html", str(tmp_path / "r.html"), "--png", str(tmp_path / "png")]) == 0
    finally:
        os.umask(umask)
    capsys.readouterr()
    written = [tmp_path / "r.html", *sorted((tmp_path / "png").iterdir())]
    assert len(written) > 2
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in written} == {"0o644"}


# ---------------------------------------------------------------------------------------------------
# 2. Root causes: bad input files
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data,needle",
    [
        (b"\xff\xfe{\x00}\x00", "not UTF-8"),  # UTF-16 (UnicodeDecodeError)
        (bytes(range(256)), "not UTF-8"),  # binary
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),  # RecursionError
        (b'{"schema_version": 1, "x": NaN}', "not a finite number"),  # canonical_json ValueError
        (b'{"a": Infinity}', "not a finite number"),
    ],
)
def test_bad_bytes_in_input_files(tmp_path, data, needle):
    path = tmp_path / "f.json"
    path.write_bytes(data)
    with pytest.raises(StratagemError, match=needle):
        read_json(path, what="plan")


def test_endless_input_is_read_bounded(tmp_path, monkeypatch):
    import planner.core.fileio as fileio

    monkeypatch.setattr(fileio, "MAX_INPUT_BYTES", 1024)
    path = tmp_path / "big.json"
    path.write_text("[" + "0," * 1000 + "0]")
    with pytest.raises(StratagemError, match="larger than"):
        fileio.read_text(path, what="plan", limit_bytes=1024)


@pytest.mark.parametrize(
    "field,value", [("alpha_s", "Infinity"), ("bus_bw_bytes_per_s", "1e300"), ("bus_bw_bytes_per_s", "-1")]
)
def test_non_finite_or_unphysical_cluster_figures_are_rejected(tmp_path, capsys, field, value):
    text = CLUSTER.read_text()
    data = json.loads(text)
    data["content_hash"] = None
    fit = (data["node_types"][0]["intra_node"] or data["inter_node"])[0]
    fit[field] = 0.5
    raw = json.dumps(data).replace(f'"{field}": 0.5', f'"{field}": {value}', 1)
    path = tmp_path / "c.json"
    path.write_text(raw)
    status, err = _run(capsys, "profile", "check", path)
    assert status == 2 and err.startswith("error:") and "\n" not in err


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda d: d["mesh"].update(sizes=[]), "mesh"),
        (lambda d: d["predictions"].update(step_time_s=0), "step_time_s"),
        (lambda d: d["predictions"]["stages"][0].update(memory_capacity_bytes=0), "memory_capacity_bytes"),
        (lambda d: d["stages"][0].update(module_paths=[]), "module_paths"),
        (lambda d: d["training"].update(lr=-1.0), "lr"),
        (lambda d: d["training"].update(seq_len=100_000), "max_seq"),
        (lambda d: d["schedule"].update(num_micro_batches=3), "num_micro_batches"),  # gone in schema 3
        (lambda d: d["schedule"].update(micro_batches_per_replica=[7]), "micro_batches_per_replica"),
        (lambda d: d["stages"][0]["module_paths"].__setitem__(0, "blocks.99"), "unknown"),
    ],
)
@pytest.mark.parametrize("command", ["show", "launch"])
def test_plans_launch_rejects_are_not_shown_either(plan_file, tmp_path, capsys, edit, needle, command):
    path = _mutated(plan_file, tmp_path, edit)
    argv = ["show", path] if command == "show" else ["launch", path, "--dry-run"]
    status, err = _run(capsys, *argv)
    assert status == 2 and err.startswith("error:") and "\n" not in err, err


@pytest.mark.parametrize(
    "line,needle",
    [
        ({"step": "x"}, "step 'x'"),
        ({"step": None}, "step None"),
        ({"step": -1}, "step -1"),
        ({"step": 0, "loss": "high"}, "loss"),
        ({"step": 0, "step_time_s": [0.2]}, "step_time_s"),
        ({"step": 0, "step_time_s": -1}, "step_time_s"),
        ({"step": 0, "peak_memory_bytes": "x"}, "peak_memory_bytes"),
    ],
)
def test_metrics_with_wrong_types(plan_file, tmp_path, capsys, line, needle):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"event": "step", **line}) + "\n")
    _one_line_error(*_run(capsys, "show", plan_file, "--metrics", path), needle)


# ---------------------------------------------------------------------------------------------------
# 2. Root causes: flags
# ---------------------------------------------------------------------------------------------------

EST = ["estimate", "--model", "gpt:tiny", "--cluster", str(CLUSTER), "--global-batch", "8", "--gpus", "2"]


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--hidden", "0"], "expected an integer"),  # ZeroDivisionError
        (["--heads", "0"], "expected an integer"),
        (["--micro-batch", "0"], "expected an integer"),
        (["--heads", "-1"], "expected an integer"),  # raw pydantic dump
        (["--layers", "99999999999999999999"], "expected an integer"),  # hang
        (["--gpus", "99999999999999999999"], "expected an integer"),
        (["--batch-shares", "nan,nan", "--gpus", "2"], "batch-shares"),
        (["--batch-shares", "1.5,-0.5"], "batch-shares"),
        (["--layers", "0"], "expected an integer"),
        (["--dropout", "2"], "expected a number"),
        (["--heads", "3"], "not divisible"),
        (["--sequence-parallel"], "needs --tp >= 2"),
        (["--stage-node-types", "a", "--replica-node-types", "b"], "exclude each other"),
        (["--model-profile", str(MODEL), "--seq", "32"], "profiled at seq"),
    ],
)
def test_estimate_flags(capsys, extra, needle):
    _one_line_error(*_run(capsys, *EST, *extra), needle)


def test_estimate_refuses_a_profile_of_another_family(capsys):
    argv = [
        "estimate",
        "--model",
        "resnet:tiny",
        "--model-profile",
        str(MODEL),
        "--cluster",
        str(CLUSTER),
        "--global-batch",
        "8",
        "--gpus",
        "2",
    ]
    _one_line_error(*_run(capsys, *argv), "profiles gpt:tiny")


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--gap", "-1"], "expected a number"),
        (["--gap", "nan"], "expected a number"),
        (["--budget", "nan"], "expected a number"),
        (["--jobs", "1e20"], "expected an integer"),
        (["--seq", "0"], "expected an integer"),
        (["--global-batch", "99999999999999999999"], "expected an integer"),
        (["--gpus", "4"], "measured inventory of 2 devices"),  # planned pp=4 on a 2-device CPU profile
        (["--gpus", "100000"], "measured inventory"),
    ],
)
def test_plan_flags(tmp_path, capsys, extra, needle):
    argv = [*PLAN, "--out", tmp_path / "p.json"]
    for i in range(0, len(extra), 2):
        if extra[i] in argv:
            argv[argv.index(extra[i]) + 1] = extra[i + 1]
        else:
            argv += extra[i : i + 2]
    _one_line_error(*_run(capsys, *argv), needle)
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--nnodes", "0"], "expected an integer"),  # ZeroDivisionError
        (["--nnodes", "-1"], "expected an integer"),  # printed --nproc-per-node -2
        (["--node-rank", "-1"], "expected an integer"),
        (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "must be below --nnodes"),
        (["--timeout-s", "0"], "expected a number"),
        (["--timeout-s", "nan"], "expected a number"),
        (["--max-restarts", "-1"], "expected an integer"),
    ],
)
def test_launch_flags(plan_file, capsys, extra, needle):
    _one_line_error(*_run(capsys, "launch", plan_file, "--dry-run", *extra), needle)


def test_launch_checkpoint_dir_that_is_a_file(plan_file, tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    _one_line_error(
        *_run(capsys, "launch", plan_file, "--dry-run", "--checkpoint-dir", f, "--checkpoint-every", "1"),
        "is a file, not a folder",
    )


def test_profile_model_flags(tmp_path, capsys):
    out = tmp_path / "m.json"
    _one_line_error(
        *_run(capsys, "profile", "model", "--model", "gpt:tiny", "--micro-batch", "1e20", "--out", out),
        "malformed --micro-batch",
    )  # C++ overflow
    _one_line_error(
        *_run(
            capsys, "profile", "model", "--model", "gpt:tiny", "--micro-batch", "1000000", "--seq", "16", "--out", out
        ),
        "would not fit in memory",
    )  # allocation failure on the ranks
    assert not out.exists()


def test_model_profile_with_tp_degree_zero_is_rejected(tmp_path, capsys):
    data = json.loads(MODEL.read_text())
    data["content_hash"] = None
    data["tp_degrees"] = [0]
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    _one_line_error(*_run(capsys, "profile", "check", path), "tp_degrees")


def test_poor_cluster_fit_warns():
    from planner.cli.cmd_profile_cluster import poor_fit_warnings
    from planner.profile import CollectiveFit

    fit = CollectiveFit(
        op="all_reduce",
        level="intra_node",
        n_ranks=2,
        alpha_s=1e-5,
        bus_bw_bytes_per_s=1e9,
        origin="measured",
        source="test",
        fit_r2=0.60,
        fit_max_rel_err=0.93,
    )
    good = fit.model_copy(update={"fit_r2": 0.99, "fit_max_rel_err": 0.1})
    assert len(poor_fit_warnings([fit, good])) == 1 and "r2 0.60" in poor_fit_warnings([fit])[0]


def test_show_refuses_predictions_without_stages(plan_file, tmp_path, capsys):
    """Fuzz finding: a plan whose predictions.stages is empty made `show` raise KeyError in its stage table."""
    path = _mutated(plan_file, tmp_path, lambda d: d["predictions"].update(stages=[]))
    status, err = _run(capsys, "show", path)
    assert status == 2 and "stages" in err and "Traceback" not in err


def test_named_pipes_are_refused_not_waited_on(tmp_path):
    """A FIFO given as an input would block open() until a writer comes: every reader refuses it in one line."""
    import os
    import subprocess
    import sys

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    plan = tmp_path / "plan.json"
    base = [sys.executable, "-m", "planner.cli.main"]
    made = subprocess.run(
        [*base, "plan", "--model", "gpt:tiny", "--cluster", "dgx-h100", "--gpus", "1", "--global-batch", "2",
         "--seq", "32", "--out", str(plan)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    cases = [
        ["plan", "--model", "gpt:tiny", "--cluster", str(fifo), "--gpus", "1", "--global-batch", "2", "--out",
         str(tmp_path / "x.json")],
        ["show", str(fifo)],
        ["launch", str(plan), "--data", str(fifo), "--dry-run"],
    ]  # fmt: skip
    for argv in cases:
        proc = subprocess.run([*base, *argv], capture_output=True, text=True, timeout=60)
        err = proc.stderr.strip()
        assert proc.returncode == 2 and err.startswith("error: ") and "\n" not in err, (argv, err)
        assert "named pipe" in err or "not a regular file" in err, (argv, err)
