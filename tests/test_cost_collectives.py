"""Collective times per algorithm, against hand-computed values on a synthetic cluster."""

import math

import pytest
from test_cost_helpers import INTER_BW, INTRA_BW, cluster

from planner.core import StratagemError
from planner.cost import collective_time

CL = cluster()
NODE = CL.node_types[0]


def t(op, nbytes, n, *, spans=False, per_node=None, algorithm="auto"):
    return collective_time(
        CL, op, nbytes, n, node_type=NODE, spans_nodes=spans, ranks_per_node=per_node or n, algorithm=algorithm
    )


def test_ring_all_reduce_intra_node_hand_computed():
    # 4 ranks: 2(n-1) = 6 steps of 1 us + 2*3/4 * 1e9 / 100e9
    assert t("all_reduce", 1e9, 4, algorithm="ring") == pytest.approx(6e-6 + 1.5 * 1e9 / INTRA_BW)


def test_all_gather_ring_uses_n_minus_1_over_n():
    assert t("all_gather", 4e8, 4) == pytest.approx(3e-6 + 0.75 * 4e8 / INTRA_BW)


def test_ring_across_nodes_takes_group_share_of_node_bandwidth_and_split_latency():
    # 8 ranks, 2 per node (4 nodes): bw = 10e9 * 2/4; steps 14, of which 2(4-1)=6 inter (1 us) and 8 intra (1 us)
    expected = 14e-6 + 2 * 7 / 8 * 1e8 / (INTER_BW * 0.5)
    assert t("all_reduce", 1e8, 8, spans=True, per_node=2, algorithm="ring") == pytest.approx(expected)


def test_tree_wins_for_small_messages_on_many_ranks_and_ring_for_large():
    ring_small = t("all_reduce", 1e3, 64, spans=True, per_node=4, algorithm="ring")
    tree_small = t("all_reduce", 1e3, 64, spans=True, per_node=4, algorithm="tree")
    assert tree_small < ring_small
    ring_big = t("all_reduce", 1e10, 64, spans=True, per_node=4, algorithm="ring")
    tree_big = t("all_reduce", 1e10, 64, spans=True, per_node=4, algorithm="tree")
    assert ring_big < tree_big
    assert t("all_reduce", 1e10, 64, spans=True, per_node=4) == pytest.approx(
        min(ring_big, tree_big, t("all_reduce", 1e10, 64, spans=True, per_node=4, algorithm="hierarchical"))
    )


def test_hierarchical_is_reduce_scatter_inter_all_reduce_all_gather():
    # 16 ranks, 4 per node, 4 nodes. Intra RS of 1e9 over 4: 3 us + 3/4 * 1e9/100e9 (x2 with the AG);
    # inter all-reduce of 1e9/4 over 4 nodes, each of the 4 ranks at 10e9/4: 6 us + 2*3/4 * 2.5e8 / 2.5e9
    rs = 3e-6 + 0.75 * 1e9 / INTRA_BW
    inter = 6e-6 + 1.5 * 2.5e8 / 2.5e9
    assert t("all_reduce", 1e9, 16, spans=True, per_node=4, algorithm="hierarchical") == pytest.approx(2 * rs + inter)


def test_parameter_server_scales_with_workers_and_loses_to_ring():
    ps = t("all_reduce", 1e8, 4, algorithm="parameter_server")
    assert ps == pytest.approx(2e-6 + 2 * 4 * 1e8 / INTRA_BW)
    assert t("all_reduce", 1e8, 4) < ps  # auto never picks it


def test_send_recv_across_nodes_gets_one_nic_share():
    assert t("send_recv", 1e8, 2, spans=True, per_node=1) == pytest.approx(1e-6 + 1e8 / (INTER_BW / 4))


def test_trivial_and_invalid():
    assert t("all_reduce", 1e9, 1) == 0.0
    assert t("all_reduce", 0, 8) == 0.0
    with pytest.raises(StratagemError, match="does not apply"):
        t("all_gather", 1e6, 4, algorithm="tree")
    assert math.isfinite(t("all_to_all", 1e6, 4))
