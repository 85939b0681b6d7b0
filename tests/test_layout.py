"""Vendor-aware Megatron layout (integrations/layout.py): pure logic, no Megatron, no processes.

Checks every placement against the vendor map (hard groups single-vendor, counts preserved,
bijection, launch order kept inside a vendor) and checks the "impossible" verdicts against an
exhaustive search over all vendor assignments on small clusters.
"""
import itertools

import pytest

from hetccl.integrations.layout import (LayoutError, ParallelSizes, megatron_groups,
                                        orthogonal_groups, plan_layout)

HARD = ("tp", "cp", "tp_cp", "ep", "etp", "tp_ep")


def split(*counts, names="abcdefgh", interleave=False):
    labels = [names[i] for i, n in enumerate(counts) for _ in range(n)]
    if interleave:  # launch ranks alternate vendors: the permutation has work to do
        pools = [[names[i]] * n for i, n in enumerate(counts)]
        labels = [x for tup in itertools.zip_longest(*pools) for x in tup if x]
    return labels


def check_layout(labels, L):
    W = len(labels)
    assert sorted(L.rank_of_launch) == list(range(W))
    assert all(L.launch_of_rank[L.rank_of_launch[l]] == l for l in range(W))
    assert L.vendor_of_rank == [labels[L.launch_of_rank[r]] for r in range(W)]
    for kind in HARD:
        for g in L.groups[kind]:
            assert len({L.vendor_of_rank[r] for r in g}) == 1, (kind, g, L.vendor_of_rank)
    # Inside a vendor, launch order is kept (neighbouring launch ranks stay neighbours).
    for v in set(labels):
        launches = [L.launch_of_rank[r] for r in range(W) if L.vendor_of_rank[r] == v]
        assert launches == sorted(launches)
    if L.placement == "replica":
        for g in L.groups["pp"]:
            assert len({L.vendor_of_rank[r] for r in g}) == 1
        assert all(len(vs) == 1 for vs in L.replica_vendors())
    # Every group kind partitions the ranks.
    for kind, gs in L.groups.items():
        assert sorted(r for g in gs for r in g) == list(range(W)), kind


def feasible_by_search(labels, sizes, order="tp-cp-ep-dp-pp"):
    """Exhaustive: is there ANY slot->vendor assignment with the right counts that keeps every
    hard group inside one vendor? (small worlds only)"""
    W = len(labels)
    groups = megatron_groups(W, sizes, order)
    vendors = sorted(set(labels))
    need = {v: labels.count(v) for v in vendors}
    for assign in itertools.product(vendors, repeat=W):
        if any(assign.count(v) != n for v, n in need.items()):
            continue
        if all(len({assign[r] for r in g}) == 1 for k in HARD for g in groups[k]):
            return True
    return False


def test_orthogonal_groups_match_megatron_docstring_example():
    # Megatron's generate_masked_orthogonal_rank_groups docstring: 8 GPUs, order tp-pp-dp,
    # sizes 2-2-2 -> dp groups [[0, 4], [1, 5], [2, 6], [3, 7]].
    sizes = {"tp": 2, "pp": 2, "dp": 2}
    assert orthogonal_groups(8, "tp-pp-dp", sizes, "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert orthogonal_groups(8, "tp-pp-dp", sizes, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert orthogonal_groups(8, "tp-pp-dp", sizes, "pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]


@pytest.mark.parametrize("counts,sizes", [
    ((2, 2), ParallelSizes(tp=2)),
    ((1, 1), ParallelSizes()),
    ((4, 4), ParallelSizes(tp=2, pp=2)),
    ((4, 2, 2), ParallelSizes(tp=2)),
    ((3, 5), ParallelSizes()),
    ((4, 4), ParallelSizes(tp=1, ep=4)),
    ((4, 4), ParallelSizes(tp=2, ep=2, etp=1)),
    ((4, 4), ParallelSizes(tp=2, cp=2)),
    ((8, 4), ParallelSizes(tp=2, pp=2)),
])
@pytest.mark.parametrize("interleave", [False, True])
def test_layout_respects_vendor_groups(counts, sizes, interleave):
    labels = split(*counts, interleave=interleave)
    L = plan_layout(labels, sizes)
    check_layout(labels, L)
    if len(counts) > 1:
        assert "dp" in L.cross_vendor  # data parallelism is what crosses vendors
    assert not set(HARD) & set(L.cross_vendor)


def test_interleaved_launch_gets_permuted():
    # torchrun order a b a b with tp=2: TP pairs must be (a, a) and (b, b).
    L = plan_layout(["a", "b", "a", "b"], ParallelSizes(tp=2))
    assert L.rank_of_launch == [0, 2, 1, 3]
    assert L.groups["tp"] == [[0, 1], [2, 3]] and L.groups["dp"] == [[0, 2], [1, 3]]
    assert L.replica_vendors() == [["a"], ["b"]]
    assert L.placement == "replica" and L.cross_vendor == ["dp", "dp_cp", "edp"]


def test_stage_placement_when_replicas_do_not_fit():
    # 2 + 6 GPUs, tp=2 pp=2: a replica needs 4 ranks, vendor a has 2 -> pipeline crosses vendors
    labels = split(2, 6)
    L = plan_layout(labels, ParallelSizes(tp=2, pp=2))
    check_layout(labels, L)
    assert L.placement == "stage" and "pp" in L.cross_vendor
    assert "stage" in L.describe()


@pytest.mark.parametrize("counts,sizes,needle", [
    ((3, 3), ParallelSizes(tp=2), "not a multiple of 2"),
    ((2, 2), ParallelSizes(tp=4), "not a multiple of 4"),
    ((6, 2), ParallelSizes(tp=1, ep=4), "not a multiple of 4"),
    ((3, 3), ParallelSizes(tp=1, cp=2), "not a multiple of 2"),
])
def test_impossible_layouts_explain(counts, sizes, needle):
    labels = split(*counts)
    assert not feasible_by_search(labels, sizes)
    with pytest.raises(LayoutError) as e:
        plan_layout(labels, sizes)
    msg = str(e.value)
    assert needle in msg and "a: " in msg and "divisors" in msg


def test_sizes_that_do_not_divide_world():
    with pytest.raises(LayoutError, match="not divisible by tp\\*cp\\*pp"):
        plan_layout(split(3, 2), ParallelSizes(tp=2))
    with pytest.raises(LayoutError, match="etp\\*ep\\*pp"):
        plan_layout(split(2, 2), ParallelSizes(tp=1, ep=3))


def _divides(counts, sizes) -> bool:
    try:
        megatron_groups(sum(counts), sizes)
        return True
    except LayoutError:
        return False


# every (vendor counts, parallel sizes) pair whose sizes divide the world (the others are
# covered by test_sizes_that_do_not_divide_world)
_SEARCH_CASES = [(c, s)
                 for c in [(2, 2), (1, 3), (2, 4), (4, 2, 2), (1, 1, 2), (3, 3), (6, 2)]
                 for s in [ParallelSizes(tp=2), ParallelSizes(tp=2, pp=2), ParallelSizes(pp=2),
                           ParallelSizes(ep=2), ParallelSizes(tp=2, ep=2, etp=1)]
                 if _divides(c, s)]


@pytest.mark.parametrize("counts,sizes", _SEARCH_CASES)
def test_layout_found_iff_one_exists(counts, sizes):
    """plan_layout succeeds exactly when an exhaustive search finds a valid placement."""
    labels = split(*counts, interleave=True)
    exists = feasible_by_search(labels, sizes)
    if exists:
        check_layout(labels, plan_layout(labels, sizes))
    else:
        with pytest.raises(LayoutError):
            plan_layout(labels, sizes)
