"""Conventions checked, not remembered (issue 12 §5): import direction, declared dependencies.

- the library (``planner`` outside ``planner/cli``) never imports ``torch``, ``runtime`` or ``planner.cli``;
  ``runtime`` never imports ``planner.cli``: the CLI is the one composition root;
- every third-party package imported by ``planner``, ``runtime`` or the tests is declared in pyproject.toml.
"""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in a file, lazy ones inside functions included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom) and node.level:  # relative: resolve against the package
            package = path.relative_to(REPO).with_suffix("").parts[: -node.level]
            out.append((node.lineno, ".".join([*package, *(node.module.split(".") if node.module else [])])))
    return out


def _files(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


def _violations(files: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{p.relative_to(REPO)}:{line} imports {name}"
        for p in files
        for line, name in _imports(p)
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    ]


def test_library_never_imports_torch_runtime_or_the_cli():
    library = [p for p in _files("planner") if "cli" not in p.relative_to(REPO / "planner").parts]
    assert len(library) > 30
    assert _violations(library, ("torch", "runtime", "planner.cli")) == []


def test_runtime_never_imports_the_cli():
    assert _violations(_files("runtime"), ("planner.cli",)) == []


def test_product_packages_never_import_generators_or_fixtures():
    assert _violations(_files("planner") + _files("runtime"), ("tools", "fixtures")) == []


def test_the_check_can_fail(tmp_path):
    bad = REPO / "planner" / "_tmp_structure_probe.py"
    try:
        bad.write_text("def f():\n    import torch.distributed\n    from runtime.launch import x\n")
        assert len(_violations([bad], ("torch", "runtime"))) == 2
    finally:
        bad.unlink()


# installed by the Makefile itself rather than declared: torchtitan goes in with --no-deps (its datasets /
# wandb / tensorboard dependencies are not needed to build its config classes)
MAKEFILE_INSTALLED = {"torchtitan"}
# installed with torch: triton comes with its CUDA wheels (imported on CUDA behind an ImportError fallback,
# runtime/executor/master_adamw.py; never declared, so CPU installs stay small), typing_extensions with every
# wheel (tools/gpu_stubs.py)
WITH_TORCH_CUDA = {"triton", "typing_extensions"}


def _declared() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + [d for extra in project["optional-dependencies"].values() for d in extra]
    return {re.split(r"[<>=!~\[ ;]", spec, maxsplit=1)[0].lower().replace("_", "-") for spec in specs}


@pytest.mark.parametrize("folder", ["planner", "runtime", "tests", "benchmarks", "tools"])
def test_every_imported_package_is_declared(folder):
    local = (
        {"planner", "runtime", "tools", "fixtures", "conftest"}
        | {p.stem for p in (REPO / "tests").glob("*.py")}
        | {p.stem for p in (REPO / "benchmarks").glob("*.py")}
        | {p.stem for p in (REPO / "tools").glob("*.py")}
    )
    dists = packages_distributions()
    declared = _declared()
    missing = set()
    for path in _files(folder):
        for _, name in _imports(path):
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top in local or top.startswith("_"):
                continue
            names = {d.lower().replace("_", "-") for d in dists.get(top, [top])}
            if top in MAKEFILE_INSTALLED and top in (REPO / "Makefile").read_text():
                continue
            if top in WITH_TORCH_CUDA:
                continue
            if not names & declared:
                missing.add(f"{top} ({path.relative_to(REPO)})")
    assert sorted(missing) == []
