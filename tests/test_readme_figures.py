"""The README's figure blocks are the benchmarks' output (tools/readme_figures.py): a figure typed by hand, or
left behind when a benchmark changes, fails here."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_readme_figure_blocks_are_the_benchmark_output():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import readme_figures
    finally:
        sys.path.pop(0)
    text = readme_figures.README.read_text(encoding="utf-8")
    regenerated, changed = readme_figures.regenerate(text)
    assert changed == [], f"run python tools/readme_figures.py (stale: {changed})"
    assert set(readme_figures.BLOCKS) <= {n for n in readme_figures.BLOCKS if f"<!-- figures: {n} -->" in text}


def test_a_stale_block_is_caught():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import readme_figures
    finally:
        sys.path.pop(0)
    text = readme_figures.README.read_text(encoding="utf-8").replace("held out, 8 rows", "held out, 9 rows")
    assert readme_figures.regenerate(text, ["long-context"])[1] == ["long-context"]
