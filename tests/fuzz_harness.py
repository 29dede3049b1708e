"""Fuzzing the CLI in-process: generated bad inputs, each run by ``planner.cli.main.main`` under a time limit.

A :class:`Case` is one command line plus what it must do: ``"error"`` (garbage: exit 2 with one ``error:``
line), ``"ok"`` (a valid control: exit 0) or ``"any"`` (a mutation that may or may not be valid: exit 0 or 2,
never a traceback). Every case must also leave the protected files of the work folder (inputs, a FIFO, a
socket, a folder, a symlink) exactly as they were, and finish within the time limit.

Classes of cases (``Case.klass``):

- ``numeric-flag``: every numeric flag of every subcommand set to zero, negative, fractional, NaN, infinite,
  huge (``1e20``, 20 digits), empty and non-numeric values;
- ``path``: output paths that are empty, end in ``/``, name a folder/FIFO/socket/symlink-to-FIFO, are too
  long, sit under a regular file, or equal an input of the same command;
- ``input-bytes``: input files that are empty, binary, UTF-16, truncated, NaN/Infinity, deeply nested;
- ``mutation``: real documents (model and cluster profile, plan, metrics) with one field changed (type,
  sign, zero, huge, null, removed) and their content hash removed;
- ``hypothesis``: random flag/value command lines drawn by hypothesis.

Used by ``tests/test_fuzz_cli.py`` (a fast sample in ``make test``) and ``benchmarks/fuzz_cli.py`` (all).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import os
import random
import shutil
import signal
import socket
import stat
import traceback
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

REPO = Path(__file__).resolve().parents[1]
Expect = Literal["error", "ok", "any"]
BAD_KINDS = ("traceback", "hang", "exit0-on-garbage", "file-replaced", "bad-message", "rejected-valid")


@dataclass(frozen=True)
class Case:
    command: str
    klass: str
    argv: tuple[str, ...]
    expect: Expect = "error"
    note: str = ""


@dataclass
class Outcome:
    case: Case
    kind: str  # "ok", "error", or one of BAD_KINDS
    status: int | None
    detail: str = ""
    seconds: float = 0.0


class _Timeout(BaseException):
    """Raised by SIGALRM inside a case that ran past its limit (a BaseException: nothing swallows it)."""


class _WouldStart(BaseException):
    """Raised instead of starting torchrun: the command accepted its input and went on to run a job."""


# ------------------------------------------------------------------------------------------------------
# The work folder: real inputs plus things that must never be replaced
# ------------------------------------------------------------------------------------------------------


@dataclass
class Workdir:
    root: Path
    files: dict[str, Path] = field(default_factory=dict)

    def __getitem__(self, key: str) -> str:
        return str(self.files[key])


def build_workdir(root: Path) -> Workdir:
    """Inputs (model/cluster profile, plans, metrics) and protected non-regular files under ``root``."""
    from planner.cli.main import main
    from planner.inspect import build_example_plan
    from planner.plan import save_plan

    root.mkdir(parents=True, exist_ok=True)
    w = Workdir(root)
    w.files["model"] = Path(shutil.copy(REPO / "profiles/models/gpt-tiny.json", root / "gpt-tiny.json"))
    w.files["cluster"] = Path(shutil.copy(REPO / "profiles/hardware/local-cpu-2core.json", root / "cpu.json"))
    w.files["plan"] = root / "plan.json"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        status = main(
            [
                "plan",
                "--model",
                "gpt:tiny",
                "--model-profile",
                w["model"],
                "--cluster",
                w["cluster"],
                "--gpus",
                "2",
                "--global-batch",
                "8",
                "--out",
                w["plan"],
            ]
        )
    assert status == 0, "the fuzz fixture plan could not be made"
    example = build_example_plan("1f1b", pp=2, num_micro_batches=4, dp=2, tp=2, tp_comm_s=0.002, pp_comm_s=0.001)
    w.files["plan8"] = save_plan(example, root / "plan8.json")
    step = example.predictions.step_time_s
    lines = [
        dict(
            event="step",
            step=i,
            loss=5.0 - i,
            step_time_s=t,
            tokens_per_s=1000.0,
            peak_memory_bytes=[2**30, 2**31],
            predicted_step_time_s=step,
        )
        for i, t in enumerate([0.9, 0.2, 0.2])
    ]
    lines.append(dict(event="summary", summary=True))
    w.files["metrics"] = root / "metrics.jsonl"
    w.files["metrics"].write_text("".join(json.dumps(x) + "\n" for x in lines))
    w.files["runs"] = root / "runs.csv"  # measured runs for `calibrate` (columns: planner/calibrate/runs.py)
    header = "model,layers,hidden,heads,seq,vocab,gpus,global_batch,micro_batch,tp,pp,dp,step_time_s"
    rows = [
        "gpt,12,1024,8,1024,51200,8,32,1,1,1,8,0.5",
        "gpt,24,2048,16,1024,51200,8,64,2,2,1,4,1.9",
        "gpt,12,1536,12,1024,51200,8,128,4,1,1,8,2.2",
    ]
    w.files["runs"].write_text("\n".join([header, *rows]) + "\n")
    w.files["dir"] = root / "a-folder"
    w.files["dir"].mkdir()
    w.files["fifo"] = root / "a-fifo"
    os.mkfifo(w.files["fifo"])
    w.files["socket"] = root / "a-socket"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(w.files["socket"]))
    sock.close()
    w.files["link"] = root / "link-to-fifo"
    w.files["link"].symlink_to(w.files["fifo"])
    w.files["regular"] = root / "regular.txt"
    w.files["regular"].write_text("keep me\n")
    w.files["scratch"] = root / "scratch"
    w.files["scratch"].mkdir()
    return w


def _fingerprint(path: Path) -> tuple:
    st = os.lstat(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else ""
    return st.st_mode, st.st_ino, st.st_size, digest


def snapshot(w: Workdir) -> dict[str, tuple]:
    return {key: _fingerprint(p) for key, p in w.files.items() if key != "scratch"}


# ------------------------------------------------------------------------------------------------------
# Running one case
# ------------------------------------------------------------------------------------------------------


def _on_alarm(signum, frame):
    raise _Timeout


@contextlib.contextmanager
def _no_jobs_started() -> Iterator[None]:
    """Replace the calls that start torchrun (launch, profile cluster) by a :class:`_WouldStart`."""
    import runtime.launch
    import runtime.profiling.cluster

    def refuse(*args, **kwargs):
        raise _WouldStart

    saved = runtime.launch.run_command, runtime.profiling.cluster.run_cluster_bench
    runtime.launch.run_command = refuse
    runtime.profiling.cluster.run_cluster_bench = refuse
    try:
        yield
    finally:
        runtime.launch.run_command, runtime.profiling.cluster.run_cluster_bench = saved


def run_case(case: Case, w: Workdir, *, timeout_s: float = 20.0) -> Outcome:
    """Run one case in this process (main thread: SIGALRM bounds it) and classify what happened."""
    import time

    from planner.cli.main import main

    before = snapshot(w)
    out, err = io.StringIO(), io.StringIO()
    status: int | None = None
    kind, detail = "", ""
    started = time.perf_counter()
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        with _no_jobs_started(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(list(case.argv))
            except SystemExit as exc:
                status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    except _Timeout:
        kind, detail = "hang", f"ran past {timeout_s:g} s"
    except _WouldStart:
        status = 0  # accepted the input and went on to start a job
    except BaseException as exc:  # noqa: BLE001 - every escape from main is a finding
        kind = "traceback"
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()[-1][:300]
        frames = traceback.extract_tb(exc.__traceback__)
        if frames:
            detail += f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    seconds = time.perf_counter() - started
    _clean_scratch(w)
    after = snapshot(w)
    changed = sorted(k for k in before if before[k] != after.get(k))
    if changed and not kind:
        kind, detail = "file-replaced", ", ".join(changed)
    if not kind:
        kind, detail = _classify(case, status, err.getvalue())
    return Outcome(case, kind, status, detail, seconds)


def _classify(case: Case, status: int | None, stderr: str) -> tuple[str, str]:
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    if status == 0:
        if case.expect == "error":
            return "exit0-on-garbage", ""
        return "ok", ""
    if status != 2 or len(errors) != 1:
        return "bad-message", f"exit {status}, stderr {stderr.strip()[-300:]!r}"
    if case.expect == "ok":
        return "rejected-valid", errors[0][:300]
    return "error", errors[0][:300]


def _clean_scratch(w: Workdir) -> None:
    scratch = w.files["scratch"]
    for child in scratch.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def run_all(cases: Iterable[Case], w: Workdir, *, timeout_s: float = 20.0) -> list[Outcome]:
    return [run_case(case, w, timeout_s=timeout_s) for case in cases]


def totals(outcomes: list[Outcome], key: str) -> dict[str, Counter]:
    """``key`` ("klass" or "command") -> Counter of outcome kinds."""
    table: dict[str, Counter] = {}
    for o in outcomes:
        table.setdefault(getattr(o.case, key), Counter())[o.kind] += 1
    return table


def failures(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if o.kind in BAD_KINDS]


# ------------------------------------------------------------------------------------------------------
# Case generators
# ------------------------------------------------------------------------------------------------------

POSITIVE_INT_BAD = ("0", "-1", "-7", "1.5", "nan", "inf", "1e20", "99999999999999999999", "", "abc", "0x10", "2 3")
NONNEG_INT_BAD = ("-1", "-7", "1.5", "nan", "inf", "1e20", "99999999999999999999", "", "abc")
POSITIVE_FLOAT_BAD = ("0", "-1", "nan", "inf", "-inf", "1e400", "", "abc", "1e20")
FRACTION_BAD = ("0", "-0.1", "1.5", "2", "nan", "inf", "", "abc")
INT_LIST_BAD = ("0", "-1", "1,0", "1,-2", "1.5", "1e20", "99999999999999999999", "", ",", "a,b", "1;2")


def base_argv(w: Workdir) -> dict[str, list[str]]:
    """A valid command line per subcommand that the numeric and path cases start from."""
    return {
        "estimate": [
            "estimate",
            "--model",
            "gpt:tiny",
            "--cluster",
            w["cluster"],
            "--global-batch",
            "8",
            "--gpus",
            "2",
        ],
        "plan": [
            "plan",
            "--model",
            "gpt:tiny",
            "--model-profile",
            w["model"],
            "--cluster",
            w["cluster"],
            "--gpus",
            "2",
            "--global-batch",
            "8",
            "--out",
            str(w.files["scratch"] / "p.json"),
        ],
        "launch": ["launch", w["plan"], "--dry-run"],
        "show": ["show", w["plan"]],
        "profile model": [
            "profile",
            "model",
            "--model",
            "gpt:tiny",
            "--analytic",
            "--cluster",
            w["cluster"],
            "--seq",
            "16",
            "--out",
            str(w.files["scratch"] / "m.json"),
        ],
        "profile cluster": [
            "profile",
            "cluster",
            "--nproc-per-node",
            "2",
            "--quick",
            "--out",
            str(w.files["scratch"] / "c.json"),
        ],
        "profile check": ["profile", "check", w["model"]],
        "calibrate": [
            "calibrate",
            "--cluster",
            "dgx-a100-80g",
            "--runs",
            w["runs"],
            "--out",
            str(w.files["scratch"] / "cal.json"),
        ],
        "export": ["export", w["plan"], "--to", "deepspeed", "--out", str(w.files["scratch"] / "ds.json")],
        "frontier": [
            "frontier",
            "--model",
            "gpt:tiny",
            "--seq",
            "64",
            "--global-batch",
            "8",
            "--train-tokens",
            "1e6",
            "--cluster",
            "dgx-h100",
            "--gpus",
            "8",
            "--jobs",
            "1",
            "--out",
            str(w.files["scratch"] / "frontier.csv"),
        ],
    }


# subcommand -> flag -> bad values (each must be refused)
NUMERIC_FLAGS: dict[str, dict[str, tuple[str, ...]]] = {
    "estimate": {
        "--layers": POSITIVE_INT_BAD,
        "--hidden": POSITIVE_INT_BAD,
        "--heads": POSITIVE_INT_BAD,
        "--vocab": POSITIVE_INT_BAD,
        "--ffn-hidden": POSITIVE_INT_BAD,
        "--seq": POSITIVE_INT_BAD,
        "--dropout": ("-0.1", "1", "2", "nan", "inf", "", "abc"),
        "--gpus": POSITIVE_INT_BAD,
        "--global-batch": POSITIVE_INT_BAD,
        "--micro-batch": POSITIVE_INT_BAD,
        "--tp": POSITIVE_INT_BAD,
        "--pp": POSITIVE_INT_BAD,
        "--dp": POSITIVE_INT_BAD,
        "--virtual-stages": POSITIVE_INT_BAD,
        "--batch-shares": ("nan,nan", "1.5,-0.5", "0.5", "0.2,0.2", "inf,0", "", "a,b", "0,1", "0.5,0.5,0"),
        "--cp": POSITIVE_INT_BAD + ("3",),  # 3: 2 x cp does not divide the sequence
        "--ep": POSITIVE_INT_BAD + ("2",),  # 2: gpt:tiny has no experts
        "--etp": POSITIVE_INT_BAD,
        "--sd": POSITIVE_INT_BAD + ("2",),  # 2: gpt:tiny is not a 3D CNN
    },
    "plan": {
        "--gpus": POSITIVE_INT_BAD,
        "--global-batch": POSITIVE_INT_BAD,
        "--seq": POSITIVE_INT_BAD,
        "--memory-fraction": FRACTION_BAD,
        "--time-limit-s": POSITIVE_FLOAT_BAD,
        "--budget-s": POSITIVE_FLOAT_BAD,
        "--gap": ("-1", "-0.01", "nan", "inf", "1", "2", "", "abc"),
        "--top-k": POSITIVE_INT_BAD,
        "--jobs": POSITIVE_INT_BAD,
        "--cp": POSITIVE_INT_BAD + ("3",),
        "--cp-min-seq": POSITIVE_INT_BAD,
    },
    "frontier": {
        "--seq": POSITIVE_INT_BAD,
        "--global-batch": POSITIVE_INT_BAD,
        "--train-tokens": POSITIVE_FLOAT_BAD,
        "--gpus": ("0", "-8", "8:4", "abc", "", "12", "1e20", "99999999999999999999"),
        "--price": ("dgx-h100=0", "dgx-h100=-1", "dgx-h100=nan", "dgx-h100=inf", "dgx-h100", "other=2", "="),
        "--pue": ("0.5", "-1", "nan", "inf", "", "abc"),
        "--deadline-days": POSITIVE_FLOAT_BAD,
        "--budget-usd": POSITIVE_FLOAT_BAD,
        "--batch-range": ("9:15", "16:8", "a:b", "", "0:0"),
        "--jobs": POSITIVE_INT_BAD,
    },
    "launch": {
        "--steps": POSITIVE_INT_BAD,
        "--checkpoint-every": NONNEG_INT_BAD,
        "--max-restarts": NONNEG_INT_BAD,
        "--nnodes": POSITIVE_INT_BAD,
        "--node-rank": NONNEG_INT_BAD + ("1", "5"),
        "--nproc-per-node": POSITIVE_INT_BAD,
        "--timeout-s": POSITIVE_FLOAT_BAD,
    },
    "profile model": {
        "--micro-batch": INT_LIST_BAD,
        "--tp": INT_LIST_BAD,
        "--seq": POSITIVE_INT_BAD,
        "--warmup": NONNEG_INT_BAD,
        "--repeats": POSITIVE_INT_BAD,
    },
    "calibrate": {"--folds": ("0", "1", "-1", "nan", "1e20", "99999999999999999999", "", "abc", "1.5")},
    "profile cluster": {
        "--nproc-per-node": POSITIVE_INT_BAD,
        "--nnodes": POSITIVE_INT_BAD,
        "--node-rank": NONNEG_INT_BAD,
        "--repeats": POSITIVE_INT_BAD,
        "--iters": POSITIVE_INT_BAD,
        "--timeout-s": POSITIVE_FLOAT_BAD,
        "--sizes": (
            "0",
            "-1",
            "1KiB..0",
            "64MiB..1KiB",
            "1KiB..1MiB:x1",
            "1XB",
            "",
            "..",
            "1e400",
            "99999999999999999999GiB",
        ),
    },
}


def _set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    argv = list(argv)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    return argv


def numeric_flag_cases(w: Workdir) -> list[Case]:
    base = base_argv(w)
    cases = []
    for command, flags in NUMERIC_FLAGS.items():
        for flag, values in flags.items():
            for value in values:
                argv = _set_flag(base[command], flag, value)
                cases.append(Case(command, "numeric-flag", tuple(argv), "error", f"{flag} {value!r}"))
    # values only wrong together with another flag
    est = base["estimate"]
    combos = [
        (est + ["--sequence-parallel"], "--sequence-parallel with tp 1"),
        (est + ["--stage-node-types", "x", "--replica-node-types", "y"], "both node-type flags"),
        (_set_flag(est, "--seq", "32") + ["--model-profile", w["model"]], "--seq differs from the profile"),
        (
            [
                "estimate",
                "--model",
                "resnet:tiny",
                "--cluster",
                w["cluster"],
                "--global-batch",
                "8",
                "--gpus",
                "2",
                "--model-profile",
                w["model"],
            ],
            "a gpt profile for a resnet model",
        ),
        (_set_flag(est, "--micro-batch", "3"), "micro-batch not dividing the batch"),
        (base["launch"] + ["--nnodes", "0"], "--nnodes 0"),
        (base["launch"] + ["--nnodes", "-1"], "--nnodes -1"),
        (base["launch"] + ["--nnodes", "2", "--node-rank", "2"], "--node-rank >= nnodes"),
        (base["launch"] + ["--checkpoint-dir", w["regular"], "--checkpoint-every", "1"], "a file as checkpoint dir"),
        (_set_flag(base["plan"], "--gpus", "4"), "--gpus 4 on a measured 2-device cluster"),
        (_set_flag(base["plan"], "--gpus", "100000"), "--gpus beyond a measured cluster"),
        (
            [
                "plan",
                "--model",
                "gpt:gpt3-175b",
                "--cluster",
                "dgx-a100-80g",
                "--gpus",
                "100000000",
                "--global-batch",
                "1536",
                "--out",
                str(w.files["scratch"] / "p.json"),
            ],
            "--gpus 1e8 on a datasheet cluster",
        ),
        (
            [
                "profile",
                "model",
                "--model",
                "gpt:tiny",
                "--micro-batch",
                "1000000",
                "--seq",
                "16",
                "--out",
                str(w.files["scratch"] / "m.json"),
            ],
            "measured --micro-batch 1e6",
        ),
        (_set_flag(base["profile model"], "--micro-batch", "1e20"), "--micro-batch 1e20"),
    ]
    for argv, note in combos:
        cases.append(
            Case(argv[0] if argv[0] != "profile" else f"profile {argv[1]}", "numeric-flag", tuple(argv), "error", note)
        )
    return cases


# subcommand -> output flags
OUTPUT_FLAGS = {
    "plan": ("--out",),
    "profile model": ("--out",),
    "profile cluster": ("--out",),
    "show": ("--html", "--png"),
    "launch": ("--metrics", "--slurm"),
    "calibrate": ("--out", "--png"),
    "export": ("--out",),
}


def path_cases(w: Workdir) -> list[Case]:
    base = base_argv(w)
    long_name = str(w.files["scratch"] / ("x" * 300 + ".json"))
    bad_paths = {
        "empty": "",
        "blank": " ",
        "trailing slash": str(w.files["scratch"] / "newdir") + "/",
        "existing folder": w["dir"],
        "folder with slash": w["dir"] + "/",
        "FIFO": w["fifo"],
        "socket": w["socket"],
        "symlink to FIFO": w["link"],
        "name too long": long_name,
        "under a file": w["regular"] + "/x.json",
        "dot": ".",
    }
    inputs = {
        "plan": ("--model-profile", "--cluster"),
        "profile model": ("--cluster",),
        "show": ("plan", "--metrics"),
        "launch": ("plan",),
        "calibrate": ("--runs",),
        "export": ("plan",),
    }
    cases = []
    for command, flags in OUTPUT_FLAGS.items():
        for flag in flags:
            start = base[command] + (["--metrics", w["metrics"]] if command == "show" and flag != "--metrics" else [])
            if command == "launch":
                start = ["launch", w["plan"]] + (["--dry-run"] if flag == "--metrics" else [])
            for note, value in bad_paths.items():
                if (command, flag) == ("show", "--png") and note in (
                    "existing folder",
                    "folder with slash",
                    "dot",
                    "trailing slash",
                ):
                    continue  # a folder is what show --png wants
                cases.append(Case(command, "path", tuple(_set_flag(start, flag, value)), "error", f"{flag} {note}"))
            for in_flag in inputs.get(command, ()):
                source = (
                    w["plan"]
                    if in_flag == "plan"
                    else (
                        w["metrics"]
                        if in_flag == "--metrics"
                        else (
                            w["model"]
                            if in_flag == "--model-profile"
                            else w["runs"]
                            if in_flag == "--runs"
                            else w["cluster"]
                        )
                    )
                )
                if (command, flag) == ("show", "--png"):
                    continue
                cases.append(
                    Case(
                        command,
                        "path",
                        tuple(_set_flag(start, flag, source)),
                        "error",
                        f"{flag} equal to the input {in_flag}",
                    )
                )
    # empty strings for input-ish flags
    for command, flag in (
        ("show", "--metrics"),
        ("profile cluster", "--sizes"),
        ("estimate", "--model-profile"),
        ("plan", "--model-profile"),
        ("launch", "--checkpoint-dir"),
        ("launch", "--data"),
    ):
        cases.append(Case(command, "path", tuple(_set_flag(base[command], flag, "")), "error", f"{flag} empty"))
    cases.append(Case("show", "path", ("show", w["plan"], "--png", w["regular"]), "error", "--png a regular file"))
    return cases


# ------------------------------------------------------------------------------------------------------
# Bad bytes and mutated documents
# ------------------------------------------------------------------------------------------------------


def _consumers(w: Workdir, kind: str, path: str) -> list[tuple[str, list[str]]]:
    """Command lines that read a document of ``kind`` from ``path``."""
    scratch = str(w.files["scratch"] / "out.json")
    if kind == "model":
        return [
            (
                "plan",
                [
                    "plan",
                    "--model",
                    "gpt:tiny",
                    "--model-profile",
                    path,
                    "--cluster",
                    w["cluster"],
                    "--gpus",
                    "2",
                    "--global-batch",
                    "8",
                    "--time-limit-s",
                    "5",
                    "--budget-s",
                    "8",
                    "--out",
                    scratch,
                ],
            ),
            (
                "estimate",
                [
                    "estimate",
                    "--model",
                    "gpt:tiny",
                    "--model-profile",
                    path,
                    "--cluster",
                    w["cluster"],
                    "--global-batch",
                    "8",
                    "--gpus",
                    "2",
                    "--seq",
                    "64",
                ],
            ),
            ("profile check", ["profile", "check", path]),
        ]
    if kind == "cluster":
        return [
            ("estimate", ["estimate", "--model", "gpt:tiny", "--cluster", path, "--global-batch", "8", "--gpus", "2"]),
            (
                "plan",
                [
                    "plan",
                    "--model",
                    "gpt:tiny",
                    "--model-profile",
                    w["model"],
                    "--cluster",
                    path,
                    "--gpus",
                    "2",
                    "--global-batch",
                    "8",
                    "--time-limit-s",
                    "5",
                    "--budget-s",
                    "8",
                    "--out",
                    scratch,
                ],
            ),
            ("profile check", ["profile", "check", path]),
        ]
    if kind == "plan":
        return [
            ("show", ["show", path]),
            ("launch", ["launch", path, "--dry-run"]),
            ("export", ["export", path, "--to", "deepspeed"]),
        ]
    if kind == "metrics":
        calibrate = ["calibrate", "--cluster", "dgx-a100-80g", "--runs", path, "--out", scratch]
        return [("show", ["show", w["plan8"], "--metrics", path])] + (
            [("calibrate", calibrate)] if path.endswith(".jsonl") else []
        )
    if kind == "runs":
        return [("calibrate", ["calibrate", "--cluster", "dgx-a100-80g", "--runs", path, "--out", scratch])]
    raise ValueError(kind)


def bad_bytes() -> dict[str, bytes]:
    return {
        "empty": b"",
        "binary": bytes(range(256)) * 4,
        "utf-16": '{"a": 1}'.encode("utf-16"),
        "latin-1": '{"name": "caf\xe9"}'.encode("latin-1"),
        "NaN": b'{"x": NaN}',
        "Infinity": b'{"x": -Infinity}',
        "nested": b"[" * 100_000 + b"]" * 100_000,
        "nested objects": b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
        "list": b"[1, 2, 3]",
        "string": b'"plan"',
        "number": b"1e999",
        "huge int": b"9" * 5000,
        "truncated": b'{"schema_version": 1, "name": "x", ',
        "null": b"null",
        "bom": b"\xef\xbb\xbf{}",
    }


def input_bytes_cases(w: Workdir) -> list[Case]:
    folder = w.root / "bytes"
    folder.mkdir(exist_ok=True)
    cases = []
    for note, data in bad_bytes().items():
        for kind in ("model", "cluster", "plan", "metrics", "runs"):
            suffix = {"metrics": ".jsonl", "runs": ".csv"}.get(kind, ".json")
            path = folder / f"{kind}-{note.replace(' ', '-')}{suffix}"
            path.write_bytes(data if kind != "metrics" or note not in ("nested",) else data + b"\n")
            for command, argv in _consumers(w, kind, str(path)):
                cases.append(Case(command, "input-bytes", tuple(argv), "error", f"{kind} file {note}"))
    for kind in ("model", "plan", "metrics"):
        for command, argv in _consumers(w, kind, w["dir"]):
            cases.append(Case(command, "input-bytes", tuple(argv), "error", f"{kind} file is a folder"))
    # a metrics file with steps of the wrong type, a plan without predictions' sense
    return cases


def _leaves(doc, prefix=()) -> Iterator[tuple[tuple, object]]:
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from _leaves(value, prefix + (key,))
        yield prefix, doc
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            yield from _leaves(value, prefix + (i,))
        yield prefix, doc
    else:
        yield prefix, doc


def _assign(doc, path: tuple, value, *, delete: bool = False):
    doc = copy.deepcopy(doc)
    node = doc
    for key in path[:-1]:
        node = node[key]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


def _mutations(leaf) -> list[tuple[str, object, Expect]]:
    """(name, new value, expectation) for one leaf; type changes are garbage, the rest may be valid."""
    if isinstance(leaf, bool):
        return [("bool->str", "x", "error"), ("bool->null", None, "any")]
    if isinstance(leaf, (int, float)):
        return [
            ("num->str", "x", "error"),
            ("num->list", [1], "error"),
            ("negative", -1, "any"),
            ("zero", 0, "any"),
            ("huge", 1e308, "any"),
            ("tiny", 1e-300, "any"),
            ("null", None, "any"),
            ("big int", 10**30, "any"),
        ]
    if isinstance(leaf, str):
        return [
            ("str->num", 12345, "any"),
            ("empty str", "", "any"),
            ("str->list", ["x"], "error"),
            ("unknown", "no-such-thing", "any"),
        ]
    if isinstance(leaf, list):
        return [("empty list", [], "any"), ("list->obj", {}, "error"), ("duplicate", leaf + leaf[:1], "any")]
    if isinstance(leaf, dict):
        return [("obj->list", [], "error"), ("empty obj", {}, "any")]
    return [("null->num", 7, "any")]


def mutation_cases(w: Workdir, *, per_document: int, seed: int = 0) -> list[Case]:
    """Up to ``per_document`` single-field mutations of each real document, hash removed (so validation,
    not the hash check, must catch them); leaves are drawn without replacement, deterministically."""
    rng = random.Random(seed)
    folder = w.root / "mutations"
    folder.mkdir(exist_ok=True)
    cases = []
    for kind, path in (
        ("model", w.files["model"]),
        ("cluster", w.files["cluster"]),
        ("plan", w.files["plan"]),
        ("plan", w.files["plan8"]),
    ):
        doc = json.loads(path.read_text())
        doc["content_hash"] = None
        choices = []
        for leaf_path, leaf in _leaves(doc):
            if not leaf_path or leaf_path[0] in ("content_hash", "provenance"):
                continue
            choices += [(leaf_path, name, value, expect) for name, value, expect in _mutations(leaf)]
            if isinstance(leaf_path[-1], str):
                choices.append((leaf_path, "removed", None, "any"))
        rng.shuffle(choices)
        for n, (leaf_path, name, value, expect) in enumerate(choices[:per_document]):
            mutated = _assign(doc, leaf_path, value, delete=name == "removed")
            out = folder / f"{path.stem}-{n}.json"
            out.write_text(json.dumps(mutated))
            where = ".".join(map(str, leaf_path))
            if "choices" in leaf_path:  # runner-ups' free-form description (int | float | str | bool values)
                expect = "any"
            for command, argv in _consumers(w, kind, str(out)):
                cases.append(Case(command, "mutation", tuple(argv), expect, f"{kind} {where}: {name}"))
    cases += metrics_mutation_cases(w)
    return cases


def metrics_mutation_cases(w: Workdir) -> list[Case]:
    folder = w.root / "metrics"
    folder.mkdir(exist_ok=True)
    good = dict(event="step", step=0, loss=5.0, step_time_s=0.2, tokens_per_s=1000.0, peak_memory_bytes=[2**30, 2**31])
    bad_steps = {
        "step str": dict(good, step="x"),
        "step null": dict(good, step=None),
        "step negative": dict(good, step=-1),
        "step float": dict(good, step=1.5),
        "step list": dict(good, step=[1]),
        "step bool": dict(good, step=True),
        "loss str": dict(good, loss="x"),
        "loss list": dict(good, loss=[1]),
        "time str": dict(good, step_time_s="x"),
        "time negative": dict(good, step_time_s=-1.0),
        "time zero": dict(good, step_time_s=0),
        "time list": dict(good, step_time_s=[0.2]),
        "time obj": dict(good, step_time_s={"a": 1}),
        "tokens str": dict(good, tokens_per_s="fast"),
        "peak str": dict(good, peak_memory_bytes="x"),
        "peak list of str": dict(good, peak_memory_bytes=["x"]),
        "peak obj bad rank": dict(good, peak_memory_bytes={"a": 1}),
        "peak negative": dict(good, peak_memory_bytes=[-5]),
        "peak nested": dict(good, peak_memory_bytes=[[1]]),
        "step huge": dict(good, step=10**30),
        "no step": {k: v for k, v in good.items() if k != "step"},
    }
    cases = []
    for note, record in bad_steps.items():
        path = folder / f"{note.replace(' ', '-')}.jsonl"
        records = [record, dict(good, step=1), dict(good, step=2)] if note != "no step" else [record]
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        for command, argv in _consumers(w, "metrics", str(path)):
            cases.append(Case(command, "mutation", tuple(argv), "error", f"metrics {note}"))
    raw = {
        "NaN loss": '{"event": "step", "step": 0, "loss": NaN, "step_time_s": 0.2}\n',
        "Infinity time": '{"event": "step", "step": 0, "loss": 1.0, "step_time_s": Infinity}\n',
        "only summary": '{"event": "summary", "summary": true}\n',
    }
    for note, text in raw.items():
        path = folder / f"{note.replace(' ', '-')}.jsonl"
        path.write_text(text)
        for command, argv in _consumers(w, "metrics", str(path)):
            cases.append(Case(command, "mutation", tuple(argv), "error", f"metrics {note}"))
    return cases


# ------------------------------------------------------------------------------------------------------
# hypothesis: random flag/value command lines
# ------------------------------------------------------------------------------------------------------


def hypothesis_cases(w: Workdir, *, examples: int, seed: int = 0) -> list[Case]:
    """Command lines drawn by hypothesis: a subcommand's valid base with 1-3 numeric flags given random
    text, integers or floats (expectation "any": each may happen to be valid)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    base = base_argv(w)
    numeric = st.one_of(
        st.integers(-(10**25), 10**25).map(str),
        st.floats(allow_nan=True).map(repr),
        st.text(max_size=6),
        st.sampled_from(["0", "1", "2", "4", "8", "-1", "nan", "1e20"]),
    )
    drawn: list[Case] = []

    @hseed(seed)
    @settings(
        max_examples=examples, database=None, deadline=None, derandomize=False, suppress_health_check=list(HealthCheck)
    )
    @given(command=st.sampled_from(sorted(NUMERIC_FLAGS)), data=st.data())
    def draw(command, data):
        flags = sorted(NUMERIC_FLAGS[command])
        chosen = data.draw(st.lists(st.sampled_from(flags), min_size=1, max_size=3, unique=True))
        argv = base[command]
        for flag in chosen:
            argv = _set_flag(argv, flag, data.draw(numeric))
        if any("\x00" in a for a in argv):
            return
        drawn.append(Case(command, "hypothesis", tuple(argv), "any", " ".join(chosen)))

    draw()
    return drawn


CLAIM_MUTATIONS = [  # (where, value, expect): a plan's figures that cannot be true (issue 24 §4)
    (("predictions", "peak_memory_bytes"), 0, "error"),
    (("predictions", "peak_memory_bytes"), -1.0, "error"),
    (("predictions", "stages", 0, "peak_memory_bytes"), 0, "error"),
    (("predictions", "step_time_s"), 0, "error"),
    (("predictions", "step_time_s"), -0.5, "error"),
    (("predictions", "samples_per_s"), 0, "error"),
    (("search",), None, "ok"),  # a hand-made plan has no search record; show says nothing is claimed optimal
]


def claim_cases(w: Workdir) -> list[Case]:
    """The plan with its hash removed and one impossible figure (or no search record), for every consumer."""
    folder = w.root / "claims"
    folder.mkdir(exist_ok=True)
    doc = json.loads(w.files["plan"].read_text())
    doc["content_hash"] = None
    cases = []
    for n, (where, value, expect) in enumerate(CLAIM_MUTATIONS):
        out = folder / f"claim-{n}.json"
        out.write_text(json.dumps(_assign(doc, where, value)))
        note = f"plan {'.'.join(map(str, where))} = {value}"
        for command, argv in _consumers(w, "plan", str(out)):
            exp = expect if expect == "error" or command == "show" else "any"
            cases.append(Case(command, "plan-claims", tuple(argv), exp, note))
    return cases


def all_cases(w: Workdir, *, mutations_per_document: int, hypothesis_examples: int, seed: int = 0) -> list[Case]:
    return (
        numeric_flag_cases(w)
        + claim_cases(w)
        + path_cases(w)
        + input_bytes_cases(w)
        + mutation_cases(w, per_document=mutations_per_document, seed=seed)
        + hypothesis_cases(w, examples=hypothesis_examples, seed=seed)
    )
