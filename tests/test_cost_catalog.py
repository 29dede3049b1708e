"""The shipped cluster profiles are what planner.profile.hardware_catalog builds, and every number is sourced."""

import json

import pytest

from planner.cli.common import PROFILES_DIR
from planner.profile import build_catalog, load_cluster_profile

CATALOG = build_catalog()


def _strip(profile):
    return {k: v for k, v in json.loads(profile.model_dump_json()).items() if k not in ("provenance", "content_hash")}


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_shipped_file_matches_catalog(name):
    shipped = load_cluster_profile(PROFILES_DIR / "hardware" / f"{name}.json")
    built = CATALOG[name]
    assert _strip(shipped) == _strip(built), "regenerate with `python -m tools.write_catalog`"
    for nt in shipped.node_types:
        assert nt.device_memory_source and nt.nic_source
        assert all(c.source for c in nt.compute) and all(f.source for f in nt.intra_node)
        # the memory bandwidth has no field of its own for a source: its figure is cited in device_memory_source
        assert f"bandwidth {nt.memory_bw_bytes_per_s / 1e9:.0f} GB/s" in nt.device_memory_source
        assert "Gb/s" in nt.nic_source  # the NIC line rate the nic_bw figure comes from
    assert all(f.source and f.origin == "derived" for f in shipped.inter_node)


def test_sizes_cover_the_published_cases():
    assert CATALOG["dgx-a100-80g"].total_devices >= 3072
    assert CATALOG["dgx-h100"].total_devices >= 6144
    assert CATALOG["mixed-a100-v100"].is_mixed
