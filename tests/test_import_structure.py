"""The planner's import structure (issue 26): no import circles between its modules, and no in-function import of
another planner module outside ``planner/cli`` (the CLI defers imports for start-up time). A circle hidden behind
an in-function import is still a circle: both are read from the source with ``ast``. Imports under
``if TYPE_CHECKING:`` are annotations only and are not edges; importing ``planner.a.b`` runs ``planner/a/__init__``
first, so it is an edge to both."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLANNER = ROOT / "planner"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PLANNER.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    return skip


@functools.cache
def _all_imports() -> tuple[tuple[str, str, int, bool], ...]:
    return tuple(_imports(_modules()))


def _imports(modules: dict[str, Path]):
    """(importer, imported module, line, in a function) for every planner import of every planner module."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                targets = [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                if not target.startswith("planner"):
                    continue
                found = resolve(target)
                while found and found != "planner":  # the packages above run first
                    if found != name and not name.startswith(found + "."):
                        yield name, found, node.lineno, node.col_offset > 0
                    found = found.rpartition(".")[0]


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_planner_has_no_import_cycles():
    edges: dict[str, set[str]] = {}
    for importer, imported, _, _ in _all_imports():
        edges.setdefault(importer, set()).add(imported)
    assert _cycles(edges) == []


def test_no_in_function_planner_imports_outside_the_cli():
    deferred = [
        f"{importer} line {line} imports {imported}"
        for importer, imported, line, inner in _all_imports()
        if inner and not importer.startswith("planner.cli")
    ]
    assert deferred == []


def test_the_check_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_planner_module_imports_another_ones_private_names():
    """A name with a leading underscore is its module's own; another module needing it means it is a shared rule
    that belongs in the open (search/costs.py once imported estimate's ``_timings_apply``)."""
    private = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("planner"):
                private += [f"{name} imports {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert [p for p in private if not p.endswith(".__version__")] == []


def _package_of(module: str) -> str | None:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "planner" and len(parts) > 1 else None


def test_library_code_enters_other_planner_packages_through_their_face():
    """``planner/`` and ``runtime/`` import another planner package's public names from the package itself
    (``from planner.cost import estimate``), never from its submodules: a package's ``__init__`` is its API, and
    its files can move without touching their users. Private names stay in their module (the test above)."""
    reached_past = []
    for folder in ("planner", "runtime"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            me = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ImportFrom) or node.level or not (node.module or "").startswith("planner."):
                    continue
                if node.module.count(".") >= 2 and _package_of(node.module) != _package_of(me):
                    public = [a.name for a in node.names if not a.name.startswith("_")]
                    reached_past += [f"{me} line {node.lineno}: from {node.module} import {n}" for n in public]
    assert reached_past == []


def test_the_planner_root_keeps_only_the_package_face():
    loose = sorted(p.name for p in PLANNER.glob("*.py") if p.name != "__init__.py")
    assert loose == []


def test_show_and_plan_with_a_model_profile_do_not_import_torch(tmp_path):
    """Checking a zoo model's layer paths needs no torch (runtime/models/paths.py): `show` and `plan
    --model-profile` stay about 2 s of CPU instead of 5."""
    import subprocess
    import sys

    profile = Path(__file__).resolve().parents[1] / "profiles" / "models" / "gpt-tiny.json"
    plan = tmp_path / "plan.json"
    code = (
        "import sys\n"
        "from planner.cli.main import main\n"
        f"assert main(['plan', '--model', 'gpt:tiny', '--model-profile', {str(profile)!r}, '--cluster', "
        f"'local-cpu-2core', '--gpus', '2', '--global-batch', '8', '--seq', '64', '--out', {str(plan)!r}]) == 0\n"
        f"assert main(['show', {str(plan)!r}]) == 0\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torch imported: False" in done.stdout


def test_launch_checks_of_a_zoo_plan_do_not_import_torch(tmp_path):
    """`stratagem launch` checks a zoo model's plan before torchrun starts (layer paths, tied embedding, context
    parallelism, experts, each replica's schedule, every stage's TP styles, an elastic run's checkpoint folder)
    without importing torch (runtime/executor/checks.py, tp_plan.py, checkpoint_dirs.py): torch's 3-4 s of imports
    would come before torchrun's own. Nor does reading the metrics file afterwards."""
    import subprocess
    import sys

    from fixtures.plans import make_plan
    from planner.model import parse_model
    from planner.plan import save_plan

    gpt, llama = parse_model("gpt:tiny"), parse_model("llama:tiny")
    plans = {
        "tp2-sp": make_plan(gpt, tp=2, split=["embed", "blocks.0", "blocks.1", "head"], sequence_parallel=["blocks.0"]),
        "pp2-1f1b": make_plan(llama, pp=2, schedule="1f1b", num_micro_batches=2),
        "cp2": make_plan(llama, cp=2),
        "ep2": make_plan(parse_model("moe:tiny"), dp=2, experts={"ep": 2}),
        "dp2-shares": make_plan(gpt, dp=2, batch_shares=[0.75, 0.25]),
    }
    for name, plan in plans.items():
        save_plan(plan, tmp_path / f"{name}.json")
    elastic = (  # two nodes of one rank each, resuming from an empty checkpoint folder
        f"nnodes=2, rdzv_endpoint='127.0.0.1:29500', elastic=True, min_gpus=1, checkpoint_dir=Path({str(tmp_path)!r}) "
        "/ 'ckpt', checkpoint_every=1, max_restarts=1"
    )
    (tmp_path / "metrics.jsonl").write_text('{"event": "summary", "steps": 1}\n')
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from planner.plan import load_plan\n"
        "from runtime.launch import LaunchOptions, check_launch\n"
        f"for path in sorted(Path({str(tmp_path)!r}).glob('*.json')):\n"
        "    check_launch(load_plan(path), LaunchOptions(plan_path=path))\n"
        f"path = Path({str(tmp_path)!r}) / 'dp2-shares.json'\n"
        f"check_launch(load_plan(path), LaunchOptions(plan_path=path, {elastic}))\n"
        # after torchrun, the CLI reads the metrics file for its summary and a preemption (runtime.executor.metrics)
        "from runtime.executor.metrics import read_metrics\n"
        f"read_metrics(Path({str(tmp_path)!r}) / 'metrics.jsonl')\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torch imported: False" in done.stdout
