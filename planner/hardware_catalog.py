"""The shipped cluster profiles, built from cited datasheet and published measured figures.

``python -m planner.hardware_catalog [--out profiles/hardware]`` writes one JSON per cluster. Every number
comes from ``benchmarks/data/hardware_specs.csv`` (quoted in each ``source`` field) or is a stated
assumption. Collective fits are origin ``derived``: the quoted NCCL-tests bus bandwidth at large messages,
and the latency NCCL's own tuning model assigns (``src/graph/tuning.cc``: ring base 8.4 us, per step
3.4 us over NVLink and 9.6 us over the network, Simple protocol — the one large training messages use):
``alpha = base + steps(n) * step``. None of the references measures latency; these are NCCL's figures.

Inter-node fits are per node (all GPUs of each node in the collective, every NIC busy), see
``planner.cost.collectives``. The achieved GEMM rate is ``GEMM_EFFICIENCY[gpu] * peak``
(``planner.cost.constants``). Node counts cover the published cases; ``stratagem estimate --gpus N``
rescales a single-type cluster (``planner.cost.placement.with_gpus``).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

from planner import __version__
from planner.cost.constants import GEMM_EFFICIENCY, gpu_family
from planner.profiles import (ClusterProfile, CollectiveFit, ComputeFigure, NodeGroup, NodeType, Provenance,
                              save_profile)

log = logging.getLogger(__name__)
GB, GIB = 1e9, 2**30
CSV = "benchmarks/data/hardware_specs.csv"
OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "all_to_all")


# NCCL tuning.cc (ncclTopoTuneModel), ring / Simple protocol: base latency and per-step hardware latency.
NCCL_BASE_S = 8.4e-6
NCCL_STEP_S = {"nvlink": 3.4e-6, "net": 9.6e-6}


@dataclass(frozen=True, kw_only=True, slots=True)
class _Link:
    """One quoted bus bandwidth (bytes/s), its hardware (for NCCL's latency), rank count and citation."""

    bus_bw: float
    hw: str
    n_ranks: int
    source: str
    all_reduce_bus_bw: float | None = None  # NVLink SHARP makes all-reduce faster than the other ops


def _fits(level: str, link: _Link) -> list[CollectiveFit]:
    fits = []
    for op in OPS:
        bw = link.all_reduce_bus_bw if (op == "all_reduce" and link.all_reduce_bus_bw) else link.bus_bw
        n = 2 if op == "send_recv" else link.n_ranks
        steps = 1 if op == "send_recv" else 2 * (n - 1) if op == "all_reduce" else n - 1
        fits.append(CollectiveFit(op=op, level=level, n_ranks=n, alpha_s=NCCL_BASE_S + steps * NCCL_STEP_S[link.hw],
                                  bus_bw_bytes_per_s=bw, origin="derived",
                                  source=link.source + "; alpha from NCCL tuning.cc (ring, Simple)"))
    return fits


def _compute(device: str, peaks: dict[str, tuple[float, str]]) -> list[ComputeFigure]:
    family = gpu_family(device)
    eff = GEMM_EFFICIENCY[family]
    return [ComputeFigure(dtype=dtype, peak_flops_per_s=peak, achieved_flops_per_s=eff * peak, origin="derived",
                          source=f"peak: {src}; achieved = GEMM_EFFICIENCY['{family}'] = {eff} x peak "
                                 f"(planner/cost/constants.py)")
            for dtype, (peak, src) in peaks.items()]


A100_SRC = f"{CSV} 'A100 SXM4' rows (glennklockwood.com A100, NVIDIA A100 datasheet r4; Megatron SC21)"
H100_SRC = f"{CSV} 'H100 SXM5 80GB' rows (glennklockwood.com h100 theoretical max table; NVIDIA H100 spec)"
V100_SRC = f"{CSV} 'V100 SXM2' rows (NVIDIA 'Programming Tensor Cores in CUDA 9'; grokipedia V100)"
P100_SRC = f"{CSV} 'P100 SXM2 (NVLink)' rows (tech4gamers Tesla P100 table)"


def a100_node() -> NodeType:
    return NodeType(
        name="dgx-a100-80g", device="NVIDIA A100-SXM4-80GB", devices_per_node=8, device_memory_bytes=int(80 * GIB),
        device_memory_source=f"80 GB HBM2e per GPU (NVIDIA A100 datasheet; nvidia-smi reports 81920 MiB); HBM2e "
                             f"bandwidth 2039 GB/s: {CSV} 'A100 SXM4 80GB' row",
        memory_bw_bytes_per_s=2039 * GB,
        compute=_compute("A100", {"bf16": (312e12, A100_SRC), "fp16": (312e12, A100_SRC),
                                  "tf32": (156e12, A100_SRC), "fp32": (19.5e12, A100_SRC)}),
        intra_node=_fits("intra_node", _Link(
            bus_bw=229.35 * GB, hw="nvlink", n_ranks=8,
            source=f"{CSV}: 8x A100 SXM4 all_reduce busBw 229.35 GB/s @1GiB (vTrain trace/a100 "
                   f"AR_GPU8_1M_1024M_LUT); same bus bandwidth assumed for the other ops")),
        nic_bw_bytes_per_s=8 * 25 * GB,
        nic_source=f"{CSV}: DGX A100 (Selene) 8 x 200 Gb/s HDR InfiniBand compute HCAs (SC21 §5)")


def h100_node(*, h200: bool = False) -> NodeType:
    name, device = ("dgx-h200", "NVIDIA H200") if h200 else ("dgx-h100", "NVIDIA H100 80GB HBM3")
    src = f"{CSV} 'H200 SXM 141GB' BF16 row (derived: same GH100 die as H100)" if h200 else H100_SRC
    ar_bw, ar_src = (475 * GB, "8x H200 all_reduce busBw peak 475 GB/s (nccl-tests issue #272)") if h200 else (
        476 * GB, "8x H100 all_reduce busBw 476 GB/s (nccl-tests issue #290, NVLS)")
    return NodeType(
        name=name, device=device, devices_per_node=8,
        device_memory_bytes=int(141 * GB) if h200 else int(80 * GIB),
        device_memory_source=(f"{CSV}: H200 HBM3e capacity 141 GB, HBM3e bandwidth 4800 GB/s" if h200 else
                              "80 GB HBM3 per GPU (NVIDIA H100 SXM5 datasheet; nvidia-smi reports 81559 MiB); HBM3 "
                              f"bandwidth 3350 GB/s: {CSV} 'H100 SXM5 80GB' row"),
        memory_bw_bytes_per_s=(4800 if h200 else 3350) * GB,
        compute=_compute("H200" if h200 else "H100", {
            "bf16": (989.4e12, src), "fp16": (989.4e12, src), "fp8": (1978.9e12, H100_SRC),
            "tf32": (494.7e12, H100_SRC), "fp32": (66.9e12, H100_SRC)}),
        intra_node=_fits("intra_node", _Link(
            bus_bw=370 * GB, all_reduce_bus_bw=ar_bw, hw="nvlink", n_ranks=8,
            source=f"{CSV}: {ar_src}; other ops ~370 GB/s effective NVLink busBw (nccl-tests issue #212, "
                   f"450 GB/s line rate minus ~20 % protocol overhead)")),
        nic_bw_bytes_per_s=8 * 50 * GB,
        nic_source=f"{CSV}: DGX H100/H200 8 x 400 Gb/s ConnectX-7 (NVIDIA DGX BasePOD reference architecture)")


def v100_node() -> NodeType:
    return NodeType(
        name="p3.16xlarge", device="Tesla V100-SXM2-16GB", devices_per_node=8, device_memory_bytes=int(16 * GIB),
        device_memory_source=f"{CSV}: V100 HBM capacity 16 GB (Alpa artifact p3.16xlarge); HBM2 bandwidth 900 GB/s "
                             f"(NVIDIA SXM2 datasheet value noted in the 'V100 (PCIe 16GB)' row)",
        memory_bw_bytes_per_s=900 * GB,
        compute=_compute("V100", {"fp16": (125e12, V100_SRC), "fp32": (15.7e12, V100_SRC)}),
        intra_node=_fits("intra_node", _Link(
            bus_bw=134.51 * GB, hw="nvlink", n_ranks=8,
            source=f"{CSV}: 8x V100 node all_reduce busBw 134.51 GB/s @1GiB (vTrain trace/v100); HBM 900 GB/s "
                   f"is the NVIDIA SXM2 datasheet value noted in the same file")),
        nic_bw_bytes_per_s=25e9 / 8,
        nic_source=f"{CSV}: AWS p3.16xlarge 25 Gb/s network (AWS spec, noted as not re-read)")


def p100_node() -> NodeType:
    return NodeType(
        name="minsky", device="Tesla P100-SXM2-16GB", devices_per_node=4, device_memory_bytes=int(16 * GIB),
        device_memory_source=f"{CSV}: P100 16GB (HBM2), HBM2 bandwidth 720 GB/s", memory_bw_bytes_per_s=720 * GB,
        compute=_compute("P100", {"fp16": (21.2e12, P100_SRC), "fp32": (10.6e12, P100_SRC)}),
        intra_node=_fits("intra_node", _Link(
            bus_bw=34 * GB, hw="nvlink", n_ranks=4,
            source="derived: Minsky pairs GPUs with 2 NVLink-1 links (2 x 20 GB/s per direction, NVIDIA P100 "
                   "whitepaper) and crosses sockets over the 38.4 GB/s X-bus; a 4-GPU ring runs at the "
                   "slower hop, ~85 % efficiency -> 34 GB/s (assumption, no measurement in the references)")),
        nic_bw_bytes_per_s=12.5 * GB,
        nic_source="EDR InfiniBand 100 Gb/s per node (IBM Systems blog 'Scaling TensorFlow and Caffe to 256 "
                   "GPUs'; task brief)")


def _inter(bw: float, source: str) -> list[CollectiveFit]:
    return _fits("inter_node", _Link(bus_bw=bw, hw="net", n_ranks=16, source=source))


HDR_INTER = (182 * GB, f"{CSV}: 2 nodes x 8 A100 with 4x HDR 200G: all_reduce busBw 86-96 GB/s "
                       f"(nccl-tests #175, #119, #100; ~91 GB/s) scaled x2 for DGX A100's 8 HCAs")
NDR_INTER = (376 * GB, f"{CSV}: NDR 400 Gb/s NIC expected NCCL busBw 46-48 GB/s per NIC (nccl-tests #290) "
                       f"x 8 NICs per DGX H100/H200")
ENA_INTER = (2.8 * GB, f"{CSV}: p3.16xlarge 25 Gb/s = 3.125 GB/s per node at ~90 % (assumed) efficiency")
EDR_INTER = (11.25 * GB, "EDR 100 Gb/s = 12.5 GB/s per node at ~90 % (assumed) efficiency")


def _cluster(name: str, description: str, nodes: list[tuple[NodeType, int]], inter: tuple, created_utc: str,
             sources: list[str]) -> ClusterProfile:
    types = {nt.name: nt for nt, _ in nodes}
    return ClusterProfile(
        name=name, description=description, node_types=list(types.values()),
        nodes=[NodeGroup(node_type=nt.name, count=count) for nt, count in nodes],
        inter_node=_inter(*inter),
        provenance=Provenance(method="datasheet", tool=f"stratagem {__version__}", created_utc=created_utc,
                              command="python -m planner.hardware_catalog", sources=sources,
                              notes="derived from datasheet and published measurements; node count covers the "
                                    "published cases and is rescaled by --gpus"))


def build_catalog(created_utc: str = "") -> dict[str, ClusterProfile]:
    """All shipped cluster profiles by name."""
    a100, h100, h200, v100, p100 = a100_node(), h100_node(), h100_node(h200=True), v100_node(), p100_node()
    base = [CSV]
    return {
        "dgx-a100-80g": _cluster("dgx-a100-80g", "DGX A100 80GB nodes (Selene-like): NVSwitch, 8x HDR 200 Gb/s",
                                 [(a100, 384)], HDR_INTER, created_utc, base + ["Narayanan et al. SC21 §5"]),
        "dgx-h100": _cluster("dgx-h100", "DGX H100 nodes: NVSwitch (NVLink4), 8x NDR 400 Gb/s", [(h100, 768)],
                             NDR_INTER, created_utc, base + ["NVIDIA DGX BasePOD reference architecture"]),
        "dgx-h200": _cluster("dgx-h200", "DGX H200 nodes: NVSwitch (NVLink4), 8x NDR 400 Gb/s", [(h200, 768)],
                             NDR_INTER, created_utc, base + ["NVIDIA DGX BasePOD reference architecture"]),
        "aws-p3-16xlarge": _cluster("aws-p3-16xlarge", "AWS p3.16xlarge: 8x V100 16GB NVLink, 25 Gb/s Ethernet",
                                    [(v100, 16)], ENA_INTER, created_utc, base + ["Alpa OSDI'22 artifact"]),
        "ibm-minsky": _cluster("ibm-minsky", "IBM Power8 S822LC (Minsky): 4x P100 NVLink, EDR InfiniBand",
                               [(p100, 64)], EDR_INTER, created_utc, base + ["Cho et al. 2017 (PowerAI DDL)"]),
        "mixed-a100-v100": _cluster(
            "mixed-a100-v100", "2 DGX A100 80GB nodes + 2 p3.16xlarge V100 nodes on the slower 25 Gb/s network",
            [(a100, 2), (v100, 2)], ENA_INTER, created_utc, base + ["mixed-cluster example (Whale, ATC'22)"]),
    }


def write_catalog(out_dir: str | Path, created_utc: str = "") -> list[Path]:
    """Write every shipped profile to ``out_dir/<name>.json`` (atomically, with content hashes)."""
    paths = []
    for name, profile in build_catalog(created_utc).items():
        paths.append(save_profile(profile, Path(out_dir) / f"{name}.json"))
        log.info("wrote %s", paths[-1])
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the shipped cluster profiles.")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "profiles" / "hardware"))
    args = parser.parse_args(argv)
    from planner.cli.common import utc_now  # CLI helper: only needed when run as a program
    for path in write_catalog(args.out, utc_now()):
        print(path)  # noqa: T201 - program output
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
