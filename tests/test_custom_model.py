"""--model py:FILE.py:FUNCTION / module:pkg.mod:FUNCTION: the README contract and its one-line errors (the example
model's TP2/PP2 training parity is in tests/test_external_parity.py)."""

from __future__ import annotations

import textwrap

import pytest
from runtime_helpers import REPO

from planner.core import StratagemError
from planner.model import parse_model
from runtime.models import layer_kind, layer_paths, tp_layout
from runtime.models.external import external
from runtime.profiling.model import profile_model_analytic

EXAMPLE = f"py:{REPO / 'examples' / 'custom_model.py'}:build"
HEADER = "import torch\nfrom torch import nn\n"


def _write(tmp_path, body: str, name: str = "model.py") -> str:
    path = tmp_path / name
    path.write_text(HEADER + textwrap.dedent(body))
    return f"py:{path}:build"


def test_example_layers_kinds_and_tp_plan():
    spec = parse_model(EXAMPLE)
    assert layer_paths(spec) == ["proj", *(f"blocks.{i}" for i in range(6)), "out"]
    assert layer_kind("blocks.2", spec) == "block" and layer_kind("out", spec) == "layer"
    assert tp_layout(spec, "blocks.0") == {"fc1": "colwise", "fc2": "rowwise"} and tp_layout(spec, "proj") == {}
    profile = profile_model_analytic(spec, seq_len=1, dtype="fp32")
    assert profile.tp_degrees == [1, 2, 4, 8, 16, 32, 64]
    assert profile.layer("blocks.0").shard(2).fwd_flops_per_sample == pytest.approx(
        profile.layer("blocks.0").shard(1).fwd_flops_per_sample / 2, rel=0.01
    )  # the LayerNorm is not split


def test_module_form_and_no_tp_plan(tmp_path, monkeypatch):
    (tmp_path / "mymodels.py").write_text(
        HEADER
        + textwrap.dedent("""
        def build():
            m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
            m.input_spec = {"sample_shape": [8], "dtype": "float32", "num_classes": 3}
            return m
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = parse_model("module:mymodels:build")
    assert layer_paths(spec) == ["blocks.0", "blocks.1", "blocks.2"]
    assert "no tp_plan" in external(spec).tp_note
    assert profile_model_analytic(spec, seq_len=1, dtype="fp32").tp_degrees == [1]


BAD = {
    "raises": ("def build():\n    raise RuntimeError('boom')\n", "raised RuntimeError: boom"),
    "not a module": ("def build():\n    return 3\n", "returned int, not an nn.Module"),
    "no input_spec": ("def build():\n    return nn.Sequential(nn.Linear(2, 2))\n", "no input_spec"),
    "out of order": (
        """
        class M(nn.Module):
            input_spec = {"sample_shape": [4], "dtype": "float32", "num_classes": 4}
            def __init__(self):
                super().__init__()
                self.b, self.a = nn.Linear(4, 4), nn.Linear(4, 4)
            def forward(self, x):
                return self.b(self.a(x))
        def build():
            return M()
    """,
        r"forward calls its layers as \[a, b\] but the children are \[b, a\]",
    ),
    "called twice": (
        """
        class M(nn.Module):
            input_spec = {"sample_shape": [4], "dtype": "float32", "num_classes": 4}
            def __init__(self):
                super().__init__()
                self.a = nn.Linear(4, 4)
            def forward(self, x):
                return self.a(self.a(x))
        def build():
            return M()
    """,
        "each child must run once",
    ),
    "bad style": (
        """
        def build():
            m = nn.Sequential(nn.Linear(4, 4))
            m.input_spec = {"sample_shape": [4], "dtype": "float32", "num_classes": 4}
            m.tp_plan = {"Linear": {"": "diagonal"}}
            return m
    """,
        "style 'diagonal' .* is unknown",
    ),
    "tp_divides": (
        """
        def build():
            m = nn.Sequential(nn.Linear(4, 4))
            m.input_spec = {"sample_shape": [4], "dtype": "float32", "num_classes": 4}
            m.tp_divides = {"heads": 0}
            return m
    """,
        r"tp_divides must be \{name: positive int\}",
    ),
    "classes": (
        """
        def build():
            m = nn.Sequential(nn.Linear(4, 5))
            m.input_spec = {"sample_shape": [4], "dtype": "float32", "num_classes": 4}
            return m
    """,
        "last dimension is 5 but input_spec says num_classes=4",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_contract_violations_are_one_line_errors(tmp_path, case):
    body, match = BAD[case]
    with pytest.raises(StratagemError, match=match) as info:
        layer_paths(parse_model(_write(tmp_path, body, name=f"m_{case.replace(' ', '_')}.py")))
    message = str(info.value)
    assert "\n" not in message and ("build" in message or ".py" in message)


@pytest.mark.parametrize(
    "text,match",
    [
        ("py:missing.py:build", "does not exist"),
        ("py:examples/custom_model.py", "must be py:FILE.py:FUNCTION"),
        ("module:no_such_module_xyz:build", "cannot import module"),
    ],
)
def test_bad_model_arguments(text, match, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(StratagemError, match=match):
        layer_paths(parse_model(text))


def test_missing_function_and_changed_file(tmp_path):
    src = _write(tmp_path, "def build():\n    return nn.Linear(2, 2)\n")
    with pytest.raises(StratagemError, match="defines no function 'nope'"):
        layer_paths(parse_model(src.replace(":build", ":nope")))
    spec = parse_model(src)
    (tmp_path / "model.py").write_text("# edited\n" + (tmp_path / "model.py").read_text())
    from runtime.models.custom import _load_function

    with pytest.raises(StratagemError, match="changed since the plan was made"):
        _load_function(spec)


HEADS_MODEL = """
    HIDDEN, HEADS = 512, 32

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, HEADS, -1).unbind(2)  # a fixed head count in the reshape
            a = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
            return x + self.proj(a.transpose(1, 2).reshape(b, s, -1))

    class M(nn.Module):
        input_spec = {"sample_shape": [16], "dtype": "int64", "vocab": 128, "num_classes": 128}
        tp_plan = {"Block": {"qkv": "colwise", "proj": "rowwise"}}

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(128, HIDDEN)
            self.blocks = nn.ModuleList(Block() for _ in range(2))
            self.head = nn.Linear(HIDDEN, 128)

        def forward(self, x):
            x = self.embed(x)
            for blk in self.blocks:
                x = blk(x)
            return self.head(x)

    def build():
        return M()

    def build_stated():
        m = M()
        m.tp_divides = {"heads": 8}
        return m
"""


def test_tp_degrees_stop_where_the_shard_cannot_run_or_the_contract_says(tmp_path):
    """A block reshaping into a fixed 32 heads: its tp=32 shard (48 qkv features) cannot be viewed as 3 x 32 heads,
    so the profile stops at 16 instead of failing at plan time ("shape '[1, 16, 3, 32, -1]' is invalid"); with
    tp_divides {"heads": 8} it stops at 8. Planning on 64 GPUs then runs."""
    from runtime.profiling.model import default_tp_degrees

    text = _write(tmp_path, HEADS_MODEL)
    spec = parse_model(text)
    assert default_tp_degrees(spec) == (1, 2, 4, 8, 16)
    assert external(spec).constraints["blocks.0"]["meta_forward_runs_up_to_tp"] == 16
    stated = parse_model(text.removesuffix(":build") + ":build_stated")
    assert default_tp_degrees(stated) == (1, 2, 4, 8)
    from planner.cli.main import main
    from planner.plan import load_plan

    out = tmp_path / "plan.json"
    argv = ["plan", "--model", text, "--cluster", "dgx-h100", "--gpus", "64", "--global-batch", "64", "--seq", "16"]
    assert main([*argv, "--out", str(out)]) == 0
    assert load_plan(out).mesh.size("tp") <= 16
