"""The shipped cluster profiles, built from cited datasheet and published measured figures.

``python -m tools.write_catalog [--out profiles/hardware]`` writes one JSON per cluster. Every number
comes from ``benchmarks/data/hardware_specs.csv`` (quoted in each ``source`` field) or is a stated
assumption. Collective fits are origin ``derived``: the quoted NCCL-tests bus bandwidth at large messages,
and the latency NCCL's own tuning model assigns (``src/graph/tuning.cc``: ring base 8.4 us, per step
3.4 us over NVLink and 9.6 us over the network, Simple protocol — the one large training messages use):
``alpha = base + steps(n) * step``. None of the references measures latency; these are NCCL's figures.

Inter-node fits are per node (all GPUs of each node in the collective, every NIC busy), see
``planner.cost.collectives``. The achieved GEMM rate is ``GEMM_EFFICIENCY[gpu] * peak``
(``planner.core.constants``). Node counts cover the published cases; ``stratagem estimate --gpus N``
rescales a single-type cluster (``planner.cost.placement.with_gpus``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from planner import __version__
from planner.core import GEMM_EFFICIENCY, gpu_family
from planner.profile.schema import (
    ClusterProfile,
    CollectiveFit,
    ComputeFigure,
    KernelModel,
    NodeGroup,
    NodePower,
    NodeType,
    Provenance,
    TileShape,
    save_profile,
)

log = logging.getLogger(__name__)
GB, GIB = 1e9, 2**30
CSV = "benchmarks/data/hardware_specs.csv"
OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "all_to_all")


# NCCL tuning.cc (ncclTopoTuneModel), ring / Simple protocol: base latency and per-step hardware latency.
NCCL_BASE_S = 8.4e-6
NCCL_STEP_S = {"nvlink": 3.4e-6, "net": 9.6e-6}


@dataclass(frozen=True, kw_only=True, slots=True)
class _Link:
    """One quoted bus bandwidth (bytes/s), its hardware (for NCCL's latency), rank count and citation.

    ``all_to_all_source``: where the all-to-all bus bandwidth comes from — a published all-to-all
    measurement that gives the same figure, or (default) "derived from the link bandwidth": NCCL runs an
    all-to-all as concurrent point-to-point sends over the same links, so its bus bandwidth (NCCL-tests
    convention ``algBw (n-1)/n``) is the link's effective bandwidth (nccl-tests issue #130).
    """

    bus_bw: float
    hw: str
    n_ranks: int
    source: str
    all_reduce_bus_bw: float | None = None  # NVLink SHARP makes all-reduce faster than the other ops
    all_to_all_source: str | None = None


DERIVED_A2A = (
    "all_to_all DERIVED from the link bandwidth (no published all-to-all measurement for this link): NCCL's "
    "all-to-all is concurrent point-to-point sends, busBw = algBw (n-1)/n (NVIDIA/nccl-tests issue #130)"
)


def _fits(level: str, link: _Link) -> list[CollectiveFit]:
    fits = []
    for op in OPS:
        bw = link.all_reduce_bus_bw if (op == "all_reduce" and link.all_reduce_bus_bw) else link.bus_bw
        n = 2 if op == "send_recv" else link.n_ranks
        # all-to-all: its n-1 sends are issued together (one ncclGroupStart/End, nccl-tests alltoall.cu):
        # one point-to-point step of latency, like send_recv
        steps = 1 if op in ("send_recv", "all_to_all") else 2 * (n - 1) if op == "all_reduce" else n - 1
        source = link.source
        if op == "all_to_all":
            source = f"{link.all_to_all_source or DERIVED_A2A}; link: {link.source}"
        fits.append(
            CollectiveFit(
                op=op,
                level=level,
                n_ranks=n,
                alpha_s=NCCL_BASE_S + steps * NCCL_STEP_S[link.hw],
                bus_bw_bytes_per_s=bw,
                origin="derived",
                source=source + "; alpha from NCCL tuning.cc (ring, Simple)",
            )
        )
    return fits


# Tile shapes a GEMM library picks from and the fraction of the ceiling each reaches: CUTLASS's SM80/SM90
# threadblock tiles (cutlass/include/cutlass/gemm/device/default_gemm_configuration.h: 128x256 and 256x128
# for fp16/bf16 tensor cores, 128x128, 128x64, 64x64 in its profiler's kernel list). Smaller tiles reload
# each operand more often per FLOP, so they reach less of the ceiling: the relative efficiencies are an
# assumption (not fitted), ordered as shared-memory reuse falls (tile m*n/(m+n): 85, 64, 43, 32).
TILES = [
    TileShape(m=256, n=128, relative_efficiency=1.0),
    TileShape(m=128, n=256, relative_efficiency=1.0),
    TileShape(m=128, n=128, relative_efficiency=0.92),
    TileShape(m=128, n=64, relative_efficiency=0.8),
    TileShape(m=64, n=64, relative_efficiency=0.65),
]
TILE_SRC = (
    "CUTLASS default_gemm_configuration.h tile shapes; relative efficiencies assumed (operand reuse "
    "per tile), not fitted"
)
# Per-kernel launch costs. Device gap between dependent kernels on one stream: ~2 us (NVIDIA blog "Getting
# Started with CUDA Graphs", 2019: a 2.9 us kernel took 3.8 us per launch back-to-back without graphs, i.e.
# ~1 us of gap plus the launch; 2 us is used as the middle of 1-3 us). Host issue time of one PyTorch
# operator: ~10 us (PyTorch eager dispatch + cudaLaunchKernel; the launch alone is 4-6 us by a public
# measurement, susun-blog.com "pegainfer (3)", and torch's Python + dispatcher adds several us: PR #32194's
# 3.3 us for a view op). Both are assumptions within the cited ranges, not fitted.
KERNEL_GAP_S = 2e-6
HOST_OP_S = 10e-6
LAUNCH_SRC = (
    "kernel_gap_s 2 us: NVIDIA 'Getting Started with CUDA Graphs' (2019) back-to-back launch gap; "
    "host_op_s 10 us: PyTorch eager dispatch + cudaLaunchKernel (4-6 us launch, public measurement; "
    "3.3 us torch op overhead, pytorch PR #32194); assumptions within those ranges"
)
# The kernel model's figure (not cost.constants.MEMORY_BW_EFFICIENCY, the streaming one the optimizer step and
# the MoE permutes use): streaming benchmarks reach 85-92 % of datasheet HBM bandwidth (BabelStream, Deakin et
# al.); a training step's element-wise kernels are short (tens of us), strided (permutes) and mix 1-byte masks,
# and reach less. 0.65 is FITTED, jointly with the A100 GEMM ceiling, on the SC21 Table 1 rows (KERNEL_SPECS).
KERNEL_MEMORY_BW_EFFICIENCY = 0.65
MEMORY_SRC = (
    "fitted 0.65 with the A100 GEMM ceiling on the 10 SC21 Table 1 rows (benchmarks/cost_accuracy.py "
    "--calibrate); streaming benchmarks reach 0.85-0.92 (BabelStream), short training kernels less"
)


# Per GPU family: SM count (architecture whitepapers), the GEMM ceiling (fitted, see each source), the
# fused-attention efficiency (FlashAttention papers).
KERNEL_SPECS: dict[str, dict] = {
    "A100": dict(
        sm_count=108,
        sm_src="NVIDIA A100 Tensor Core GPU Architecture whitepaper: 108 SMs (A100 SXM4)",
        gemm_ceiling=0.72,
        ceiling_src="fitted with memory_bw_efficiency on the 10 SC21 Table 1 rows "
        "(grid search in steps of 0.02 / 0.05; benchmarks/cost_accuracy.py --calibrate); validated on the "
        "other rows",
        flash=0.6,
        flash_src="FlashAttention-2 (Dao 2023) abstract: 50-73 % of A100 peak; 0.6 assumed",
    ),
    "H100": dict(
        sm_count=132,
        sm_src="NVIDIA H100 Tensor Core GPU Architecture whitepaper: 132 SMs (H100 SXM5)",
        gemm_ceiling=0.64,
        ceiling_src="fitted: Megatron-LM README H100 table GPT-177B row (solves to "
        "0.643; benchmarks/cost_accuracy.py --calibrate); the other 7 rows validate it",
        flash=0.5,
        flash_src="FlashAttention-3 (Shah et al. 2024) abstract: FA2 35 %, FA3 up to 75 % of "
        "H100 peak; 0.5 assumed for cuDNN/TE fused attention of 2024",
    ),
    "V100": dict(
        sm_count=80,
        sm_src="NVIDIA Tesla V100 GPU Architecture whitepaper: 80 SMs (V100 SXM2)",
        gemm_ceiling=0.88,
        ceiling_src="fitted: Megatron-LM tables.tex GPT-2 1.2B on one V100 "
        "(1121 ms; solves to 0.882; benchmarks/cost_accuracy.py --calibrate)",
        flash=0.5,
        flash_src="assumption (FlashAttention v1 supports V100 poorly; not validated)",
    ),
    "P100": dict(
        sm_count=56,
        sm_src="NVIDIA Tesla P100 whitepaper: 56 SMs (P100 SXM2)",
        gemm_ceiling=0.88,
        ceiling_src="assumption: the V100 value (no P100 reference run here)",
        flash=0.5,
        flash_src="assumption (not validated)",
    ),
}
KERNEL_SPECS["H100"].update(
    unaligned=0.20,
    unaligned_src="0.20: measured on one H100 SXM5 80GB (torch 2.11, CUDA 13.0; benchmarks/data/h100/"
    "gemm_unaligned.csv): LM-head GEMMs at vocabulary 50,257 vs 50,304, time ratio median 0.197 over 24 shape "
    "pairs (range 0.18-0.23); the hidden 768/1024 pairs alone give 0.195, the held-out 1600/4096 pairs 0.201",
)
KERNEL_SPECS["H200"] = {**KERNEL_SPECS["H100"], "sm_src": "same GH100 die as H100 (hardware_specs.csv): 132 SMs"}


# Overlapped communication is not free: NCCL runs one thread block per channel on an SM (NCCL docs,
# NCCL_MIN_NCHANNELS / NCCL_MAX_CTAS) and streams through HBM, so GEMMs running beside a collective lose
# roughly the SM share NCCL takes: 8-16 channels of 108-132 SMs, 6-15 %. 0.1 is that estimate (not fitted);
# the torchtitan FSDP2 rows in benchmarks/data/published_cases.csv hardly tell 0 from 0.2 (mean |error|
# 4.4 / 4.1 / 4.2 % at 0 / 0.1 / 0.2).
CONTENTION = 0.1
CONTENTION_SRC = (
    "0.1: NCCL's SM share while a collective runs (one CTA per channel, NCCL docs NCCL_MIN_NCHANNELS/"
    "NCCL_MAX_CTAS; 8-16 channels of 108-132 SMs); not fitted, checked on the torchtitan FSDP2 rows"
)


def kernel_model(family: str) -> KernelModel:
    """The shipped per-kernel model of a GPU family (every value with its source in ``sources``)."""
    spec = KERNEL_SPECS[family]
    return KernelModel(
        sm_count=spec["sm_count"],
        tile_shapes=TILES,
        gemm_ceiling=spec["gemm_ceiling"],
        memory_bw_efficiency=KERNEL_MEMORY_BW_EFFICIENCY,
        kernel_gap_s=KERNEL_GAP_S,
        host_op_s=HOST_OP_S,
        flash_attention_efficiency=spec["flash"],
        comm_compute_contention=CONTENTION,
        unaligned_gemm_efficiency=spec.get("unaligned"),
        sources={
            **({"unaligned_gemm_efficiency": spec["unaligned_src"]} if "unaligned" in spec else {}),
            "comm_compute_contention": CONTENTION_SRC,
            "sm_count": spec["sm_src"],
            "tile_shapes": TILE_SRC,
            "gemm_ceiling": spec["ceiling_src"],
            "memory_bw_efficiency": MEMORY_SRC,
            "kernel_gap_s": LAUNCH_SRC,
            "host_op_s": LAUNCH_SRC,
            "flash_attention_efficiency": spec["flash_src"],
        },
    )


def default_kernel_model(device: str) -> KernelModel | None:
    """The shipped kernel model for a device name (None for CPUs and unknown devices)."""
    family = gpu_family(device)
    return kernel_model(family) if family in KERNEL_SPECS else None


def _compute(device: str, peaks: dict[str, tuple[float, str]]) -> list[ComputeFigure]:
    family = gpu_family(device)
    if family is None:
        raise ValueError(f"{device!r} is not a GPU with a GEMM efficiency in planner.core.constants.GEMM_EFFICIENCY")
    eff = GEMM_EFFICIENCY[family]
    return [
        ComputeFigure(
            dtype=dtype,
            peak_flops_per_s=peak,
            achieved_flops_per_s=eff * peak,
            origin="derived",
            source=f"peak: {src}; achieved = GEMM_EFFICIENCY['{family}'] = {eff} x peak (planner/core/constants.py)",
        )
        for dtype, (peak, src) in peaks.items()
    ]


A100_SRC = f"{CSV} 'A100 SXM4' rows (glennklockwood.com A100, NVIDIA A100 datasheet r4; Megatron SC21)"
H100_SRC = f"{CSV} 'H100 SXM5 80GB' rows (glennklockwood.com h100 theoretical max table; NVIDIA H100 spec)"
V100_SRC = f"{CSV} 'V100 SXM2' rows (NVIDIA 'Programming Tensor Cores in CUDA 9'; grokipedia V100)"
P100_SRC = f"{CSV} 'P100 SXM2 (NVLink)' rows (tech4gamers Tesla P100 table)"


# Energy and price figures (benchmarks/data/hardware_specs.csv rows named in each source)
PUE = 1.56
PUE_SRC = f"{CSV}: data centre PUE 1.56 (Uptime Institute Global Data Center Survey 2024, industry average)"
PRICE_SRC = (
    "on-demand LIST price, not a quote: midpoint of the specialty-cloud on-demand range {range} per GPU-hour "
    f"(Mercatus AI, 'Cloud GPU pricing', May 2026; {CSV}); hyperscalers list more, reserved capacity less; "
    "override with stratagem frontier --price"
)


def _power(*, board_w: float, idle_w: float, system_kw: float, device: str, system: str) -> NodePower:
    """A DGX node's power: 8 boards at ``board_w`` and the system's maximum input ``system_kw`` (the rest is host)."""
    return NodePower(
        board_w=board_w,
        idle_w=idle_w,
        host_w=system_kw * 1000 - 8 * board_w,
        pue=PUE,
        source=f"{CSV}: '{device}' TDP and idle rows; '{system}' system power (max) row; host = system max - "
        f"8 x TDP; {PUE_SRC}",
    )


def a100_node() -> NodeType:
    return NodeType(
        name="dgx-a100-80g",
        device="NVIDIA A100-SXM4-80GB",
        devices_per_node=8,
        device_memory_bytes=int(80 * GIB),
        device_memory_source=f"80 GB HBM2e per GPU (NVIDIA A100 datasheet; nvidia-smi reports 81920 MiB); HBM2e "
        f"bandwidth 2039 GB/s: {CSV} 'A100 SXM4 80GB' row",
        memory_bw_bytes_per_s=2039 * GB,
        compute=_compute(
            "A100",
            {
                "bf16": (312e12, A100_SRC),
                "fp16": (312e12, A100_SRC),
                "tf32": (156e12, A100_SRC),
                "fp32": (19.5e12, A100_SRC),
            },
        ),
        intra_node=_fits(
            "intra_node",
            _Link(
                bus_bw=229.35 * GB,
                hw="nvlink",
                n_ranks=8,
                source=f"{CSV}: 8x A100 SXM4 all_reduce busBw 229.35 GB/s @1GiB (vTrain trace/a100 "
                f"AR_GPU8_1M_1024M_LUT); same bus bandwidth assumed for the other ops",
            ),
        ),
        nic_bw_bytes_per_s=8 * 25 * GB,
        nic_source=f"{CSV}: DGX A100 (Selene) 8 x 200 Gb/s HDR InfiniBand compute HCAs (SC21 §5)",
        kernel_model=kernel_model("A100"),
        power=_power(board_w=400, idle_w=53, system_kw=6.5, device="A100 SXM4", system="DGX A100"),
        price_per_gpu_hour=1.30,
        price_source=PRICE_SRC.format(range="$1.10-1.50"),
    )


def h100_node(*, h200: bool = False) -> NodeType:
    name, device = ("dgx-h200", "NVIDIA H200") if h200 else ("dgx-h100", "NVIDIA H100 80GB HBM3")
    src = f"{CSV} 'H200 SXM 141GB' BF16 row (derived: same GH100 die as H100)" if h200 else H100_SRC
    ar_bw, ar_src = (
        (475 * GB, "8x H200 all_reduce busBw peak 475 GB/s (nccl-tests issue #272)")
        if h200
        else (476 * GB, "8x H100 all_reduce busBw 476 GB/s (nccl-tests issue #290, NVLS)")
    )
    return NodeType(
        name=name,
        device=device,
        devices_per_node=8,
        device_memory_bytes=int(141 * GB) if h200 else int(80 * GIB),
        device_memory_source=(
            f"{CSV}: H200 HBM3e capacity 141 GB, HBM3e bandwidth 4800 GB/s"
            if h200
            else "80 GB HBM3 per GPU (NVIDIA H100 SXM5 datasheet; nvidia-smi reports 81559 MiB); HBM3 "
            f"bandwidth 3350 GB/s: {CSV} 'H100 SXM5 80GB' row"
        ),
        memory_bw_bytes_per_s=(4800 if h200 else 3350) * GB,
        compute=_compute(
            "H200" if h200 else "H100",
            {
                "bf16": (989.4e12, src),
                "fp16": (989.4e12, src),
                "fp8": (1978.9e12, H100_SRC),
                "tf32": (494.7e12, H100_SRC),
                "fp32": (66.9e12, H100_SRC),
            },
        ),
        intra_node=_fits(
            "intra_node",
            _Link(
                bus_bw=370 * GB,
                all_reduce_bus_bw=ar_bw,
                hw="nvlink",
                n_ranks=8,
                source=f"{CSV}: {ar_src}; other ops ~370 GB/s effective NVLink busBw (nccl-tests issue #212, "
                f"450 GB/s line rate minus ~20 % protocol overhead)",
                all_to_all_source=f"all_to_all PUBLISHED: {CSV} '8x H100 SXM (NVSwitch)' row, ~370 GB/s busBw of "
                "non-allreduce operations (NVIDIA/nccl-tests issue #212, maintainer; all-to-all is one of them)",
            ),
        ),
        nic_bw_bytes_per_s=8 * 50 * GB,
        nic_source=f"{CSV}: DGX H100/H200 8 x 400 Gb/s ConnectX-7 (NVIDIA DGX BasePOD reference architecture)",
        kernel_model=kernel_model("H200" if h200 else "H100"),
        power=_power(
            board_w=700,
            idle_w=121,
            system_kw=10.2,
            device="H200 SXM 141GB" if h200 else "H100 SXM5 80GB",
            system="DGX H200" if h200 else "DGX H100",
        ),
        price_per_gpu_hour=4.00 if h200 else 3.00,
        price_source=PRICE_SRC.format(range="$3.50-4.50" if h200 else "$2.50-3.50"),
    )


def v100_node() -> NodeType:
    return NodeType(
        name="p3.16xlarge",
        device="Tesla V100-SXM2-16GB",
        devices_per_node=8,
        device_memory_bytes=int(16 * GIB),
        device_memory_source=f"{CSV}: V100 HBM capacity 16 GB (Alpa artifact p3.16xlarge); HBM2 bandwidth 900 GB/s "
        f"(NVIDIA SXM2 datasheet value noted in the 'V100 (PCIe 16GB)' row)",
        memory_bw_bytes_per_s=900 * GB,
        compute=_compute("V100", {"fp16": (125e12, V100_SRC), "fp32": (15.7e12, V100_SRC)}),
        intra_node=_fits(
            "intra_node",
            _Link(
                bus_bw=134.51 * GB,
                hw="nvlink",
                n_ranks=8,
                source=f"{CSV}: 8x V100 node all_reduce busBw 134.51 GB/s @1GiB (vTrain trace/v100); HBM 900 GB/s "
                f"is the NVIDIA SXM2 datasheet value noted in the same file",
            ),
        ),
        nic_bw_bytes_per_s=25e9 / 8,
        nic_source=f"{CSV}: AWS p3.16xlarge 25 Gb/s network (AWS spec, noted as not re-read)",
        kernel_model=kernel_model("V100"),
    )


def p100_node() -> NodeType:
    return NodeType(
        name="minsky",
        device="Tesla P100-SXM2-16GB",
        devices_per_node=4,
        device_memory_bytes=int(16 * GIB),
        device_memory_source=f"{CSV}: P100 16GB (HBM2), HBM2 bandwidth 720 GB/s",
        memory_bw_bytes_per_s=720 * GB,
        compute=_compute("P100", {"fp16": (21.2e12, P100_SRC), "fp32": (10.6e12, P100_SRC)}),
        intra_node=_fits(
            "intra_node",
            _Link(
                bus_bw=34 * GB,
                hw="nvlink",
                n_ranks=4,
                source="derived: Minsky pairs GPUs with 2 NVLink-1 links (2 x 20 GB/s per direction, NVIDIA P100 "
                "whitepaper) and crosses sockets over the 38.4 GB/s X-bus; a 4-GPU ring runs at the "
                "slower hop, ~85 % efficiency -> 34 GB/s (assumption, no measurement in the references)",
            ),
        ),
        nic_bw_bytes_per_s=12.5 * GB,
        nic_source="EDR InfiniBand 100 Gb/s per node (IBM Systems blog 'Scaling TensorFlow and Caffe to 256 "
        "GPUs'; task brief)",
        kernel_model=kernel_model("P100"),
    )


def _inter(bw: float, source: str, a2a_source: str | None = None) -> list[CollectiveFit]:
    return _fits("inter_node", _Link(bus_bw=bw, hw="net", n_ranks=16, source=source, all_to_all_source=a2a_source))


# Inter-node all-to-all: one NIC per GPU (an all-to-all cannot aggregate NICs: NVIDIA/nccl-tests issue #267,
# maintainer sjeaugey; "CX-7 NICs at NDR rate should achieve up to 48-49 GB/s per NIC", AddyLaddy), so the
# per-node fit (all NICs busy, planner.cost.collectives convention) is 8 x the per-NIC figure.
NDR_A2A = (
    f"all_to_all PUBLISHED: {CSV} 'NDR 400Gb/s NIC' all-to-all row: all-to-all runs at one NIC's "
    "bandwidth per GPU, 48-49 GB/s on NDR CX-7 (NVIDIA/nccl-tests issue #267); 47 GB/s x 8 NICs per node"
)


HDR_INTER = (
    182 * GB,
    f"{CSV}: 2 nodes x 8 A100 with 4x HDR 200G: all_reduce busBw 86-96 GB/s "
    f"(nccl-tests #175, #119, #100; ~91 GB/s) scaled x2 for DGX A100's 8 HCAs",
)
NDR_INTER = (
    376 * GB,
    f"{CSV}: NDR 400 Gb/s NIC expected NCCL busBw 46-48 GB/s per NIC (nccl-tests #290) x 8 NICs per DGX H100/H200",
)
ENA_INTER = (2.8 * GB, f"{CSV}: p3.16xlarge 25 Gb/s = 3.125 GB/s per node at ~90 % (assumed) efficiency")
EDR_INTER = (11.25 * GB, "EDR 100 Gb/s = 12.5 GB/s per node at ~90 % (assumed) efficiency")


def _cluster(
    name: str,
    description: str,
    nodes: list[tuple[NodeType, int]],
    inter: tuple,
    created_utc: str,
    sources: list[str],
    a2a_source: str | None = None,
) -> ClusterProfile:
    types = {nt.name: nt for nt, _ in nodes}
    return ClusterProfile(
        name=name,
        description=description,
        node_types=list(types.values()),
        nodes=[NodeGroup(node_type=nt.name, count=count) for nt, count in nodes],
        inter_node=_inter(inter[0], inter[1], a2a_source),
        provenance=Provenance(
            method="datasheet",
            tool=f"stratagem {__version__}",
            created_utc=created_utc,
            command="python -m tools.write_catalog",
            sources=sources,
            notes="derived from datasheet and published measurements; node count covers the "
            "published cases and is rescaled by --gpus",
        ),
    )


def build_catalog(created_utc: str = "") -> dict[str, ClusterProfile]:
    """All shipped cluster profiles by name."""
    a100, h100, h200, v100, p100 = a100_node(), h100_node(), h100_node(h200=True), v100_node(), p100_node()
    base = [CSV]
    return {
        "dgx-a100-80g": _cluster(
            "dgx-a100-80g",
            "DGX A100 80GB nodes (Selene-like): NVSwitch, 8x HDR 200 Gb/s",
            [(a100, 384)],
            HDR_INTER,
            created_utc,
            base + ["Narayanan et al. SC21 §5"],
        ),
        "dgx-h100": _cluster(
            "dgx-h100",
            "DGX H100 nodes: NVSwitch (NVLink4), 8x NDR 400 Gb/s",
            [(h100, 768)],
            NDR_INTER,
            created_utc,
            base + ["NVIDIA DGX BasePOD reference architecture"],
            NDR_A2A,
        ),
        "dgx-h200": _cluster(
            "dgx-h200",
            "DGX H200 nodes: NVSwitch (NVLink4), 8x NDR 400 Gb/s",
            [(h200, 768)],
            NDR_INTER,
            created_utc,
            base + ["NVIDIA DGX BasePOD reference architecture"],
            NDR_A2A,
        ),
        "aws-p3-16xlarge": _cluster(
            "aws-p3-16xlarge",
            "AWS p3.16xlarge: 8x V100 16GB NVLink, 25 Gb/s Ethernet",
            [(v100, 16)],
            ENA_INTER,
            created_utc,
            base + ["Alpa OSDI'22 artifact"],
        ),
        "ibm-minsky": _cluster(
            "ibm-minsky",
            "IBM Power8 S822LC (Minsky): 4x P100 NVLink, EDR InfiniBand",
            [(p100, 64)],
            EDR_INTER,
            created_utc,
            base + ["Cho et al. 2017 (PowerAI DDL)"],
        ),
        "mixed-a100-v100": _cluster(
            "mixed-a100-v100",
            "2 DGX A100 80GB nodes + 2 p3.16xlarge V100 nodes on the slower 25 Gb/s network",
            [(a100, 2), (v100, 2)],
            ENA_INTER,
            created_utc,
            base + ["mixed-cluster example (Whale, ATC'22)"],
        ),
    }


def write_catalog(out_dir: str | Path, created_utc: str = "") -> list[Path]:
    """Write every shipped profile to ``out_dir/<name>.json`` (atomically, with content hashes)."""
    paths = []
    for name, profile in build_catalog(created_utc).items():
        paths.append(save_profile(profile, Path(out_dir) / f"{name}.json"))
        log.info("wrote %s", paths[-1])
    return paths
