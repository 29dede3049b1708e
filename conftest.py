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
