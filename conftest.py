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
