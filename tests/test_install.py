"""A non-editable install works outside the repository, and every imported package is a declared dependency.

The wheel is built from this checkout and installed (not editable) into a fresh venv. To avoid downloading torch
again, that venv reads the already-installed dependencies from this interpreter's site-packages through a .pth
path line (which does not activate this checkout's editable install); stratagem itself comes only from the wheel.
The commands then run from an empty folder, where ``profiles/`` does not exist.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from runtime_helpers import REPO

pytestmark = pytest.mark.slow
OPTIONAL = {"transformers"}  # the [hf] extra: imported only for hf: models, with a one-line error when absent
# installed with torch's CUDA wheels, imported only on CUDA behind an ImportError fallback (the bf16-master
# optimizer's fused kernel, runtime/executor/master_adamw.py); not declared, so CPU installs never pull it in
WITH_TORCH_CUDA = {"triton"}
IMPORT_NAMES = {"pyyaml": "yaml"}  # distribution -> import name where they differ


def _run(cmd: list, cwd: Path, timeout_s: float = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, (cmd, proc.stdout[-2000:], proc.stderr[-2000:])
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, REPO], out)
    return next(out.glob("stratagem-*.whl"))


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel) -> Path:
    root = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", "--without-pip", root / "v"], root)
    python = root / "v" / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", wheel], root)
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], root).stdout.strip())
    (site / "_deps_from_dev_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return root / "v"


def test_shipped_profiles_are_found_from_another_folder(venv, tmp_path):
    where = _run([venv / "bin" / "python", "-c", "import planner; print(planner.__file__)"], tmp_path).stdout
    assert str(venv) in where and str(REPO) not in where  # the installed copy, not this checkout
    plan = tmp_path / "plan.json"
    _run(
        [
            venv / "bin" / "stratagem",
            "plan",
            "--model",
            "gpt:tiny",
            "--cluster",
            "dgx-a100-80g",
            "--gpus",
            8,
            "--global-batch",
            16,
            "--out",
            plan,
        ],
        tmp_path,
    )
    assert json.loads(plan.read_text())["cluster_name"] == "dgx-a100-80g"
    est = _run(
        [
            venv / "bin" / "stratagem",
            "estimate",
            "--model",
            "gpt:tiny",
            "--cluster",
            "dgx-h100",
            "--global-batch",
            8,
            "--json",
        ],
        tmp_path,
    )
    assert json.loads(est.stdout)["step_time_s"] > 0
    assert not (tmp_path / "profiles").exists()


def test_every_module_of_the_wheel_imports(venv, wheel, tmp_path):
    modules = [
        n[:-3].replace("/", ".").removesuffix(".__init__")
        for n in zipfile.ZipFile(wheel).namelist()
        if n.endswith(".py")
    ]
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\nprint(len(sys.argv) - 1)"
    done = _run([venv / "bin" / "python", "-c", code, *modules], tmp_path)
    assert int(done.stdout) == len(modules) > 50


def _third_party_imports(root: Path) -> set[str]:
    names: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("planner", "runtime")}


def test_every_imported_package_is_declared(wheel):
    metadata = next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith("METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    required = {
        re.split(r"[ <>=!~;\[]", line.split(":", 1)[1].strip())[0].lower()
        for line in text.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    }
    extras = {
        re.split(r"[ <>=!~;\[]", line.split(":", 1)[1].strip())[0].lower()
        for line in text.splitlines()
        if line.startswith("Requires-Dist:") and 'extra == "hf"' in line
    }
    declared = {IMPORT_NAMES.get(d, d) for d in required}
    imported = _third_party_imports(REPO / "planner") | _third_party_imports(REPO / "runtime")
    imported -= WITH_TORCH_CUDA
    assert imported - OPTIONAL <= declared, f"imported but not declared: {sorted(imported - OPTIONAL - declared)}"
    assert OPTIONAL <= extras
