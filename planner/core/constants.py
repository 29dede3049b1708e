"""Named constants of the cost model, each with where it came from.

Hardware *datasheet* numbers live in the cluster profiles (built by ``planner.profile.hardware_catalog`` from
``benchmarks/data/hardware_specs.csv``); this file holds the few *modelling* constants: how much of the
datasheet a real training step reaches, and what the framework costs in memory and bytes.

GEMM efficiency — ONE constant per GPU type
--------------------------------------------
Since the per-kernel model (``planner/cost/kernels.py``, parameters in each GPU node type's ``kernel_model``)
times every layer that has an op list (all GPT/Llama profiles), this constant only fills the profiles'
``achieved_flops_per_s``: the layer-level fallback for layers without an op list (ResNet, MLP, measured
profiles on another device) and the GEMM window that hides TP communication (``overlap_tp_comm``).
``GEMM_EFFICIENCY[gpu]`` is the achieved fraction of dense tensor-core peak for the matrix multiplies of a
transformer layer (the cluster profile's ``achieved_flops_per_s = efficiency * peak_flops_per_s``). Every
other part of a layer's time is modelled separately (memory-bound element-wise traffic, TP collectives),
so this constant is the GEMM rate alone. How each was chosen (one named reference, then held fixed):

- **A100**: Korthikanti et al. 2022 (arXiv:2205.05198) Table 4, the GPT-22B layer *baseline* (tp 8, micro
  batch 4, seq 2048, no recompute, no SP): forward 7.7 ms + backward 11.9 ms = 19.6 ms. Subtracting this
  model's element-wise traffic time and its four TP all-reduces leaves the GEMM time; 3 x the layer's
  forward FLOPs over that time gives the rate: 0.741, used as 0.74 (``tests/test_cost_calibration.py``
  re-derives it). The per-layer rows are not end-to-end validation cases: nothing validated was fitted.
- **H100**: Megatron-LM README H100 table, the GPT-177B row (tp 8, pp 6, 2304 GPUs, 432.8 TFLOP/s/GPU) —
  the GPT-3 architecture of the A100 reference and the middle of the table — solved for the constant
  (``benchmarks/cost_accuracy.py --calibrate``) with the configuration assumed there (micro-batch 1, no
  recompute, SP, flash attention, distributed optimizer, TP-comm overlap: the table does not state
  them); it solves to 0.595, rounded to 0.60; that row is marked "calib" and left out of the error mean.
  The other rows imply 0.46 (1.7B) to 0.64 (314B): small GEMMs do not fill an H100, which one constant
  cannot express. H200 shares the GH100 die and clocks (hardware_specs.csv "H200 ... same GH100 compute
  die"), so it shares the constant.
- **V100**: Megatron-LM ``images/tables.tex`` GPT-2 1.2B on one V100 (1121 ms/iteration, batch 8), solved
  the same way (0.764, used as 0.76); that row is marked "calib".
- **P100**: no reference run with a complete configuration is available here (the seed papers report
  time-to-accuracy only), so P100 uses the V100 value as a stated assumption, unvalidated.
"""

from __future__ import annotations

# Achieved fraction of dense fp16/bf16 tensor peak for transformer GEMMs (see the module docstring).
GEMM_EFFICIENCY: dict[str, float] = {
    "A100": 0.74,
    "H100": 0.60,
    "H200": 0.60,
    "V100": 0.76,
    "P100": 0.76,
}

# Achieved fraction of datasheet HBM bandwidth for streaming element-wise kernels. BabelStream-class
# measurements reach 85-92 % of datasheet on A100/H100/V100 (Deakin et al., BabelStream results); the low
# end is used because training kernels are shorter than the benchmark's. Assumption, not fitted.
MEMORY_BW_EFFICIENCY = 0.85

# HBM traffic of memory-bound (non-GEMM) kernels per byte saved for backward, forward pass, by category of
# saved bytes (ShardProfile fields). Derived by counting the reads and writes of Megatron-LM's fused
# kernels in one GPT block (LayerNorm, bias-dropout-add, bias-GeLU, scale-mask-softmax, dropout) against
# Korthikanti et al. 2022 §4's saved-activation terms:
#   replicated (LN/dropout region):  22 sbh traffic / 10 sbh saved  = 2.2
#   attention scores:                13 as^2b     / 5 as^2b         = 2.6
#   tensor-split rest (GEMM inputs): 16 sbh/t     / 24 sbh/t        = 0.67
# (A dropout-free layer would be 8 as^2b / 2 as^2b = 4.0 for the scores; the profile does not say whether
# dropout is on, so the Megatron value is used for every layer — an under-estimate without dropout.)
TRAFFIC_PER_SAVED_BYTE = {"replicated": 2.2, "scores": 2.6, "split": 0.67}
# Backward element-wise kernels read the saved input and the incoming gradient and write the outgoing one
# (softmax-backward 3 tensors vs 2 forward, LayerNorm-backward 3 vs 2, GeLU-backward 3 vs 2): ~1.3x the
# forward traffic per kernel; the dropout backward only re-reads the mask (~1x). Weighted: 1.2.
BACKWARD_TRAFFIC_FACTOR = 1.2

# Bytes per parameter of mixed-precision AdamW: fp16/bf16 weights (2) + fp16/bf16 gradients (2) + fp32
# master weights, momentum and variance (4 + 4 + 4 = 12). Rajbhandari et al. 2020 (ZeRO) §3.1: "2Ψ + 2Ψ +
# KΨ with K = 12". In fp32 training there is no master copy: 4 + 4 + 8.
STATE_BYTES_PER_PARAM = {
    "mixed": {"params": 2, "grads": 2, "optimizer": 12},
    "fp32": {"params": 4, "grads": 4, "optimizer": 8},
}

# HBM bytes one AdamW step touches per parameter (apex/Megatron multi-tensor FusedAdam): read fp32 master,
# m, v, grad (16); write master, m, v (12); write the 16-bit copy (2); gradient-norm clipping re-reads the
# gradient (2 in 16-bit). Total 32 bytes; the step is memory-bound (arithmetic intensity < 1 FLOP/byte).
OPTIMIZER_BYTES_PER_PARAM = 32
# torch.optim.AdamW on fp32 parameters as Stratagem's runtime steps it under autocast (foreach, unfused: PyTorch
# torch/optim/adam.py ``_multi_tensor_adam`` with decoupled weight decay), fp32 bytes read + written per
# parameter by its foreach kernels: weight decay mul_ 8, lerp_ of m 12, mul_ of v 8, addcmul_ of v 16, sqrt 8,
# div_ 8, add_ eps 8, addcdiv_ of the weights 16. Total 84 (autocast profiles: memory.optimizer_bytes_per_param).
TORCH_ADAMW_BYTES_PER_PARAM = 84
# AdamW arithmetic per parameter (for devices without a memory-bandwidth figure): ~12 FLOPs
# (two moment updates, bias corrections, sqrt, divide, decay, update). PyTorch torch.optim.AdamW source.
OPTIMIZER_FLOPS_PER_PARAM = 12

# Framework memory on each GPU that the model's tensors do not account for: the CUDA context with
# PyTorch's kernels loaded, cuBLAS workspaces and NCCL's per-peer buffers. PyTorch "CUDA semantics"
# notes the context is outside the caching allocator; ~0.5-1 GiB is the commonly reported size on
# A100/H100 with torch 2.x. Assumption: 1 GiB per GPU, 0 on CPU devices.
CUDA_CONTEXT_BYTES = 1 << 30
# Caching-allocator fragmentation as a fraction of allocated bytes. ZeRO (Rajbhandari et al. 2020 §3.2,
# "memory fragmentation ... OOM with over 30 % of memory still available" in extreme cases) motivates a
# margin; 10 % is the assumption used here, applied to every device.
FRAGMENTATION_FRACTION = 0.10
# Gradient-bucket buffers of data parallelism: torch DDP's default bucket_cap_mb = 25 (torch.nn.parallel.
# DistributedDataParallel docs); one bucket reducing while the next fills -> 2 buckets.
DDP_BUCKET_BYTES = 25 * 2**20
DDP_BUCKETS_IN_FLIGHT = 2
# FSDP/ZeRO-3 keeps the current and the prefetched layer unsharded (FSDP limit_all_gathers: 2 in flight).
ZERO3_LAYERS_IN_FLIGHT = 2
# DeepSpeed ZeRO-3 keeps parameters with fewer elements than this replicated ("stage3_param_persistence_
# threshold", default 1e5 in the DeepSpeed config docs; the early-2021 _allgather_param skipped tensors of
# <= 100000 elements the same way): biases and LayerNorm weights of a GPT block are never gathered.
DEEPSPEED_PERSISTENCE_THRESHOLD_ELEMENTS = 100_000
# DeepSpeed's ZeRO "reduce_bucket_size" default, 5e8 elements (deepspeed/runtime/zero/constants.py,
# ZERO_OPTIMIZATION_REDUCE_BUCKET_SIZE_DEFAULT, unchanged since 2020): gradients are reduced in buckets of
# at most this many elements (a larger tensor forms a bucket of its own).
DEEPSPEED_REDUCE_BUCKET_ELEMENTS = 500_000_000
# Selene's fabric under a whole job's load (planner.profile.load.FabricLoad points: job nodes -> share of the
# inter-node fits' bus bandwidth). The cluster profiles' inter-node fits come from nccl-tests on 2 nodes, where
# no other flows cross the switches: 1.0 at 2 nodes by construction. On Selene itself (a 3-level fat tree, 8x
# HDR per DGX A100 node), Narayanan et al. SC21 §5.9 report the data-parallel all-reduces of the 1T run
# (3,072 GPUs, 384 nodes) at an effective bisection bandwidth of 12.9 TB/s: 67 GB/s per node of one half,
# 0.37 of the 182 GB/s two-node figure. Between the two the share is taken linear in log(nodes) (FabricLoad);
# Hoefler, Schneider & Lumsdaine, "Multistage Switches are not Crossbars: Effects of Static Routing in
# High-Performance Networks", IEEE Cluster 2008 (doi:10.1109/CLUSTR.2008.4663762), show why it falls with the
# job's size (statically routed flows share upper-level links; 55-60 % effective bisection bandwidth on their
# large full-bisection clusters). That shape between the points is an assumption; both points are measured,
# nothing is fitted. benchmarks/cost_accuracy.py gives it to the SC21 Table 2 rows (48-280 nodes).
SELENE_FABRIC_LOAD = ((2, 1.0), (384, 0.37))
SELENE_FABRIC_LOAD_SOURCE = (
    "Selene, Narayanan et al. SC21 §5.9: 12.9 TB/s effective bisection bandwidth for the 384-node 1T run's "
    "data-parallel all-reduce = 0.37 of the 2-node nccl-tests figure (1.0 at 2 nodes by construction); "
    "linear in log(nodes) between (planner/core/constants.py SELENE_FABRIC_LOAD)"
)
# Host time of one light eager ATen call on CUDA tensors (a view, narrow, or the dispatch of a copy_):
# PyTorch's operator micro-benchmark printed in pytorch/pytorch PR #32194 (Jan 2020, the torch 1.4-1.8 era):
# `split` on CUDA tensors, eager, 3.3 us per call. A copy_ also launches a kernel (cudaLaunchKernel adds a
# few us more), so as the cost of a copy this is a lower bound.
EAGER_OP_OVERHEAD_S = 3.3e-6

# Load imbalance of dropless Mixture-of-Experts routing: tokens the busiest expert-parallel rank receives
# over the mean, applied to its expert GEMMs and all-to-all (planner.cost.moe). FITTED on one published pair:
# yanring/Megatron-MoE-ModelZoo best_practice/qwen3/readme.md, "Long Context" table, Qwen3-235B-A22B on 256
# H100, seq 16384, DeepEP, 295 TFLOP/s/GPU with --moe-router-force-load-balancing and 237 dropless (aux loss,
# from the released checkpoint): the imbalance at which the cost model's dropless / forced step ratio is
# 295/237 = 1.245 is 1.50 (benchmarks/moe_validation.py, the `calib` row of benchmarks/data/moe_runs.csv;
# the other rows' errors are printed there). A capacity factor (Switch Transformer's 1.25, Fedus et al. 2021
# Table 1, the former default) is a cap on a rank's tokens, not the mean slowdown, and undershoots this
# measurement (ratio 1.11 at 1.25). A plan with a capacity factor uses that instead (tokens padded to capacity).
# The imbalance belongs to the trained router: Mixtral-8x22B's published forced/dropless pair (465/445
# TFLOP/s) gives 1.031 (benchmarks/data/moe_runs.csv `imbalance_from`); 1.5 stays the default.
MOE_LOAD_IMBALANCE = 1.5
# Per trained router (the model family in the model's name), each FITTED on that router's one published
# forced/dropless pair (benchmarks/moe_validation.py ``router_fits``; rows in benchmarks/data/moe_runs.csv).
# A router with no published pair gets MOE_LOAD_IMBALANCE; ``plan --moe-imbalance`` overrides both.
MOE_ROUTER_IMBALANCE = {
    "mixtral": (1.031, "Mixtral-8x22B's forced/dropless pair, 465/445 TFLOP/s (Megatron-Core MoE README)"),
    "qwen3": (1.5, "Qwen3-235B-A22B's forced/dropless pair at 16k tokens, 295/237 TFLOP/s (Megatron-MoE-ModelZoo)"),
}


def gpu_family(device: str) -> str | None:
    """``'A100'`` for ``'NVIDIA A100-SXM4-80GB'`` etc.; ``None`` when the device is not a known GPU."""
    upper = device.upper()
    for family in GEMM_EFFICIENCY:
        if family in upper:
            return family
    return None


def is_gpu(device: str) -> bool:
    """Whether a device name is a GPU (it then carries a CUDA context in memory)."""
    lower = device.lower()
    return gpu_family(device) is not None or any(tag in lower for tag in ("gpu", "nvidia", "tesla", "cuda"))


# FlashAttention-2 (Dao 2023, arXiv:2307.08691) §3.1.1 "Causal masking": a causal flash kernel skips the
# blocks whose keys all come after its queries, about half of the s x s blocks at long sequence; with
# ParallelConfig.causal_skip the cost model times a flash kernel on this fraction of the score FLOPs and
# counts the model FLOPs of attention the same way (the causal half; SC21 eq. 3 counts the full square).
CAUSAL_FLASH_WORK_FRACTION = 0.5

# The dtype fused (flash) attention runs in, when it differs from the GEMMs': Transformer Engine's FP8 recipes
# cast the linear layers' GEMMs to FP8 and leave DotProductAttention in BF16 unless ``fp8_dpa`` is set
# (TE ``DelayedScaling(fp8_dpa=False)`` default; NeMo/Megatron FP8 runs before 2025 used that default).
ATTENTION_DTYPE = {"fp8": "bf16"}

# Fused causal attention's achieved fraction of the (BF16) peak at long sequence (>= 32k tokens), counted in
# causal FLOPs, used with ParallelConfig.causal_skip in place of the node's kernel_model.flash_attention_efficiency
# (an assumption made for short sequences). H100: fitted on ONE row, NeMo's Llama-2-7B at 1,048,576 tokens on
# 1,024 H100 (TP8 CP32, 536 TFLOP/s per GPU; benchmarks/data/long_context_cases.csv), where attention is 97 % of
# the FLOPs; the other rows of that file are its validation (benchmarks/long_context_accuracy.py). Consistent
# with FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608, Fig. 5: causal, head dim 128, 8k-16k tokens,
# about 610-660 TFLOP/s of 989 = 0.62-0.67). Other GPUs keep their kernel model's figure.
LONG_CAUSAL_FLASH_EFFICIENCY: dict[str, float] = {"H100": 0.68}

# Achieved FP8 GEMM throughput as a fraction of what the kernel model would give at the FP8 datasheet peak
# (2x BF16 on H100): Transformer Engine's per-tensor scaling adds cast and amax kernels around every FP8 GEMM
# and its FP8 GEMMs run below the BF16 ones' efficiency. H100: fitted on ONE row, NeMo's Llama-2-7B at 4,096
# tokens on 4 H100 (FP8, no CP, 768 TFLOP/s per GPU; benchmarks/data/long_context_cases.csv) jointly with
# LONG_CAUSAL_FLASH_EFFICIENCY; the 8k and 16k rows and the CP rows validate it.
FP8_GEMM_PEAK_FRACTION: dict[str, float] = {"H100": 0.70}
