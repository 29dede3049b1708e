"""Unaligned GEMMs (``planner.cost.kernels.aligned``): slowed where a stored operand's leading dimension is not
a multiple of 16 bytes, on node types with a measured ``unaligned_gemm_efficiency`` only."""

from __future__ import annotations

import pytest

from planner.cost import Device, gemm_s, op_backward
from planner.profile import OpProfile, load_cluster_profile, resolve_cluster_path


def _device(cluster: str) -> Device:
    node = load_cluster_profile(resolve_cluster_path(cluster)).node_types[0]
    return Device.of_node(node, "bf16")


def test_h100_lm_head_at_an_odd_vocabulary_is_five_times_slower():
    dev = _device("dgx-h100")
    assert dev.km.unaligned_gemm_efficiency == pytest.approx(0.20)
    odd, padded = gemm_s(8192, 50257, 1024, 1, dev), gemm_s(8192, 50304, 1024, 1, dev)
    assert odd / padded == pytest.approx(1 / 0.20, rel=0.02)  # measured: 4.4-5.4x (benchmarks/data/h100)


def test_a100_has_no_measured_penalty():
    dev = _device("dgx-a100-80g")
    assert dev.km.unaligned_gemm_efficiency is None
    assert gemm_s(8192, 50257, 1024, 1, dev) / gemm_s(8192, 50304, 1024, 1, dev) == pytest.approx(1.0, rel=0.01)


def test_weight_gradient_reduces_over_tokens_that_are_no_leading_dimension():
    """An MLP GEMM over 1,001 tokens: the forward and the input gradient keep aligned leading dimensions
    (4096, 1024); the weight gradient's reduction runs over the tokens, which no operand is laid out by."""
    dev = _device("dgx-h100")
    op = OpProfile(kind="gemm", name="fc1", rows_per_sample=1001, n=4096, k=1024)
    odd_tokens = op_backward(op, 1, dev).kernel_s
    op_even = op.model_copy(update={"rows_per_sample": 1008})
    even_tokens = op_backward(op_even, 1, dev).kernel_s
    assert odd_tokens == pytest.approx(even_tokens, rel=0.05)
    assert gemm_s(1024, 4096, 1001, 1, dev) > 4 * gemm_s(1024, 4096, 1001, 1, dev, lead=(1024, 4096))
