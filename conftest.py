"""Names the doctests of planner/ and runtime/ use without importing them (pytest --doctest-modules)."""

import pytest


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    from planner.model import parse_model

    doctest_namespace["parse_model"] = parse_model
    try:  # runtime needs torch; the planner's doctests do not
        from fixtures.plans import make_plan
        from runtime.models import build_model

        doctest_namespace.update(make_plan=make_plan, build_model=build_model)
    except ImportError:
        pass


# Test files that take longest, first: `make test` runs files on two pytest-xdist workers (--dist loadfile) in
# collection order, so a long file collected last would run alone at the end.
_LONGEST_FIRST = (
    "test_notebooks.py",
    "test_reshard.py",
    "test_init_from.py",
    "test_elastic.py",
    "test_runtime_faults.py",
    "test_tune_run.py",
    "test_moe_parity.py",
    "test_search_proofs.py",
    "test_runtime_parity.py",
    "test_hf_moe_ep.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


# CPU seconds per test phase (this process and the children it waited for: torchrun, its ranks, CLI runs), so
# `make test` can print the tests that cost this 2-core machine most (the suite is CPU-bound: wall time is about
# half the CPU time). Each report carries the CPU used since the previous report of its worker.
_CPU_LAST: list[float] = []


def _cpu_now() -> float:
    import os
    import resource
    import sys

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    # ranks forked by this worker's zygotes (tests/runtime_helpers.py) are the zygotes' children, not ours: their
    # CPU and the zygotes' own, from /proc (utime, stime, cutime, cstime), while a zygote lives
    helpers = sys.modules.get("runtime_helpers")
    for zygote in getattr(helpers, "_ZYGOTES", ()):
        try:
            with open(f"/proc/{zygote.proc.pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return total


def pytest_runtest_logstart():
    if not _CPU_LAST:
        _CPU_LAST.append(_cpu_now())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport():
    outcome = yield
    now = _cpu_now()
    outcome.get_result().user_properties.append(("cpu_s", now - _CPU_LAST[0]))
    _CPU_LAST[0] = now


def pytest_terminal_summary(terminalreporter, config):
    """With --cpu-top N (make test: 25): the N test files that used most CPU, and their largest tests."""
    top = config.getoption("cpu_top")
    if not top:
        return
    per_test: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for rep in reports:
            for key, value in getattr(rep, "user_properties", ()):
                if key == "cpu_s":
                    per_test[rep.nodeid] = per_test.get(rep.nodeid, 0.0) + value
    per_file: dict[str, float] = {}
    for nodeid, cpu in per_test.items():
        per_file[nodeid.split("::")[0]] = per_file.get(nodeid.split("::")[0], 0.0) + cpu
    total = sum(per_file.values())
    terminalreporter.write_sep("=", f"CPU time: {total / 60:.1f} min in all; the {top} costliest files")
    for path, cpu in sorted(per_file.items(), key=lambda kv: -kv[1])[:top]:
        tests = sorted(((c, n) for n, c in per_test.items() if n.startswith(path + "::")), reverse=True)
        largest = f"{tests[0][0]:6.1f} s {tests[0][1].split('::', 1)[1][:70]}" if tests else ""
        terminalreporter.write_line(f"{cpu:7.1f} s  {path:<38} largest: {largest}")


def pytest_addoption(parser):
    parser.addoption("--cpu-top", type=int, default=0, help="print the N test files that used most CPU time")
