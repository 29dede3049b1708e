"""Shipped profile files validate; broken ones fail with one line naming the fix; schemas and docs are current."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from planner.core import StratagemError, content_hash
from planner.profile import ClusterProfile, ModelProfile, load_cluster_profile, load_model_profile
from tools.schema_export import SCHEMAS, render_schema, stale_schemas

PROFILES = Path(__file__).resolve().parents[1] / "profiles"
HARDWARE = sorted((PROFILES / "hardware").glob("*.json"))
MODELS = sorted((PROFILES / "models").glob("*.json"))


def _ids(paths: list[Path]) -> list[str]:
    return [p.name for p in paths]


@pytest.mark.parametrize("path", HARDWARE, ids=_ids(HARDWARE))
def test_shipped_cluster_profile_validates(path):
    prof = load_cluster_profile(path)
    data = json.loads(path.read_text())
    assert data.get("content_hash") == content_hash(data), "shipped files carry a correct content_hash"
    for node in prof.node_types:
        for fit in node.intra_node + prof.inter_node:
            assert fit.source, f"{fit.op}/{fit.level}: every fit says where it came from"
            if fit.origin == "measured":
                assert fit.samples, f"{fit.op}/{fit.level}: measured fits keep their raw samples"


@pytest.mark.parametrize("path", MODELS, ids=_ids(MODELS))
def test_shipped_model_profile_validates(path):
    load_model_profile(path)
    data = json.loads(path.read_text())
    assert data.get("content_hash") == content_hash(data)


def test_local_cpu_profile_is_shipped_and_measured():
    prof = load_cluster_profile(PROFILES / "hardware" / "local-cpu-2core.json")
    assert prof.provenance.method == "measured" and prof.inter_node == []
    assert "inter_node" in prof.provenance.notes  # says it was not measured, never invents it
    ops = {f.op for f in prof.node_types[0].intra_node}
    assert ops == {"all_reduce", "all_gather", "reduce_scatter", "send_recv", "all_to_all"}  # all_to_all: MoE


# ------------------------------------------------------------------------------------------ broken files


@pytest.fixture()
def good_cluster_data() -> dict:
    return json.loads((PROFILES / "hardware" / "local-cpu-2core.json").read_text())


def _write(tmp_path: Path, data: dict | str) -> Path:
    path = tmp_path / "broken.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def _one_line_error(path: Path) -> str:
    with pytest.raises(StratagemError) as info:
        load_cluster_profile(path)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_corrupt_json_names_the_fix(tmp_path, good_cluster_data):
    text = json.dumps(good_cluster_data)[:-40]  # truncated mid-file
    message = _one_line_error(_write(tmp_path, text))
    assert "not valid JSON" in message and "regenerate" in message


def test_wrong_schema_version_names_the_fix(tmp_path, good_cluster_data):
    good_cluster_data["schema_version"] = 99
    message = _one_line_error(_write(tmp_path, good_cluster_data))
    assert "schema_version 99" in message and "reads version 2" in message and "regenerate" in message


def test_field_level_error_names_the_field(tmp_path, good_cluster_data):
    good_cluster_data["node_types"][0]["devices_per_node"] = 0
    good_cluster_data.pop("content_hash")
    message = _one_line_error(_write(tmp_path, good_cluster_data))
    assert "'node_types.0.devices_per_node'" in message and "regenerate" in message


def test_tampered_content_hash_names_the_fix(tmp_path, good_cluster_data):
    good_cluster_data["node_types"][0]["intra_node"][0]["alpha_s"] *= 0.5  # hand-edited, hash kept
    message = _one_line_error(_write(tmp_path, good_cluster_data))
    assert "content_hash mismatch" in message and "regenerate" in message


def test_model_profile_loader_rejects_a_cluster_file(tmp_path, good_cluster_data):
    with pytest.raises(StratagemError, match="invalid at|schema_version 2"):
        load_model_profile(_write(tmp_path, good_cluster_data))


@pytest.mark.parametrize("breakage", ["corrupt", "version", "field", "hash"])
def test_cli_check_exits_2_with_one_line(tmp_path, good_cluster_data, breakage):
    data: dict | str = good_cluster_data
    if breakage == "corrupt":
        data = "{ not json"
    elif breakage == "version":
        good_cluster_data["schema_version"] = 0
    elif breakage == "field":
        good_cluster_data["nodes"][0]["count"] = -1
        good_cluster_data.pop("content_hash")
    else:
        good_cluster_data["name"] = "edited"
    res = subprocess.run(
        [sys.executable, "-m", "planner.cli.main", "profile", "check", str(_write(tmp_path, data))],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("error: ") and "regenerate" in res.stderr


def test_cli_check_accepts_shipped_files():
    files = [str(p) for p in HARDWARE + MODELS]
    res = subprocess.run(
        [sys.executable, "-m", "planner.cli.main", "profile", "check", *files],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("ok ") == len(files)


# ------------------------------------------------------------------------------------------ schemas, docs


def test_json_schemas_are_up_to_date():
    stale = stale_schemas()
    assert stale == [], f"stale schema files {stale}; run: python -m tools.schema_export"


def test_json_schema_matches_model_fields():
    schema = json.loads(render_schema(ClusterProfile))
    assert set(schema["properties"]) == set(ClusterProfile.model_fields)
    assert set(SCHEMAS) == {"model-profile.schema.json", "cluster-profile.schema.json", "plan.schema.json"}


def _profile_classes(root: type[BaseModel]) -> list[type[BaseModel]]:
    """Every pydantic class reachable from ``root`` through its fields, root first."""
    seen: list[type[BaseModel]] = []
    todo = [root]
    while todo:
        cls = todo.pop(0)
        if cls in seen:
            continue
        seen.append(cls)
        for field in cls.model_fields.values():
            stack = [field.annotation]
            while stack:
                tp = stack.pop()
                if isinstance(tp, type) and issubclass(tp, BaseModel):
                    todo.append(tp)
                stack.extend(getattr(tp, "__args__", ()))
    return seen


@pytest.mark.parametrize(
    "cls",
    sorted({c for r in (ModelProfile, ClusterProfile) for c in _profile_classes(r)}, key=lambda c: c.__name__),
    ids=lambda c: c.__name__,
)
def test_readme_documents_every_field(cls):
    readme = (PROFILES / "README.md").read_text()
    heading = f"### `{cls.__name__}`"
    assert heading in readme, f"profiles/README.md has no section {heading}"
    section = readme.split(heading, 1)[1].split("\n### ", 1)[0]
    missing = [name for name in cls.model_fields if f"| `{name}` |" not in section]
    assert not missing, f"profiles/README.md section {cls.__name__} lacks rows for {missing}"


def test_version_1_cluster_profile_migrates_with_the_catalog_kernel_model(tmp_path):
    """A file written before kernel models existed (schema 1) still loads, its GPU node types gain the catalog's
    kernel model, its CPU node types none; a tampered v1 file is still refused."""
    v2 = json.loads((PROFILES / "hardware" / "mixed-a100-v100.json").read_text())
    v1 = {k: v for k, v in v2.items() if k not in ("calibration", "content_hash")}
    v1["schema_version"] = 1
    v1["node_types"] = [{k: v for k, v in nt.items() if k != "kernel_model"} for nt in v1["node_types"]]
    v1["content_hash"] = content_hash(v1)
    loaded = load_cluster_profile(_write(tmp_path, v1))
    assert loaded.schema_version == 2
    ceilings = {nt.name: nt.kernel_model.gemm_ceiling for nt in loaded.node_types}
    assert ceilings == {nt["name"]: nt["kernel_model"]["gemm_ceiling"] for nt in v2["node_types"]}
    cpu = json.loads((PROFILES / "hardware" / "local-cpu-2core.json").read_text())
    cpu1 = {k: v for k, v in cpu.items() if k not in ("calibration", "content_hash")}
    cpu1["schema_version"] = 1
    cpu1["node_types"] = [{k: v for k, v in nt.items() if k != "kernel_model"} for nt in cpu1["node_types"]]
    assert load_cluster_profile(_write(tmp_path, cpu1)).node_types[0].kernel_model is None
    v1["name"] = "edited"
    assert "content_hash mismatch" in _one_line_error(_write(tmp_path, v1))
