"""The README's and benchmarks/data/h200's GPU tables are what `gpu_speed.py --from-data` prints from the stored
runs."""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "benchmarks" / "data" / "h200"


def _table() -> str:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_speed
    finally:
        sys.path.pop(0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        gpu_speed.print_table(gpu_speed.from_data(DATA, None))
    return out.getvalue()


def test_readme_gpu_tables_are_the_benchmark_output():
    table = _table()
    assert "llama3-8b-l8_mb1_s8192" in table and "gpt2-large_mb4 " in table
    for doc in (REPO / "README.md", DATA / "README.md"):
        assert table in doc.read_text(encoding="utf-8"), f"{doc}: regenerate with gpu_speed.py --from-data {DATA}"


def test_cast_kernels_are_recognised():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from gpu_speed import is_cast_kernel
    finally:
        sys.path.pop(0)
    assert is_cast_kernel("aten::copy_") and is_cast_kernel("triton_poi_fused__to_copy_3")
    assert not is_cast_kernel("triton_red_fused__to_copy_add_native_layer_norm_view_5")  # a norm that also casts
    assert not is_cast_kernel("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT")
