import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headway.decode.shapes import MC_SIM_7B_63, StaticShape, chain, from_accuracies, mc_sim_7b_63
from headway.decode.tree import (TreeBuffers, ancestor_mask, check_parents, retrieve_indices, root_paths,
                                 tree_attention_mask, tree_depth, tree_position_ids)


@st.composite
def trees(draw, max_nodes=40):
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    return torch.tensor(parents)


def ancestors_by_walking(parents, i):
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


def test_hand_drawn_tree():
    #      0
    #    /   \
    #   1     2
    #  / \     \
    # 3   4     5
    #     |
    #     6
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 4])
    assert tree_depth(parents).tolist() == [0, 1, 1, 2, 2, 2, 3]
    anc = ancestor_mask(parents).int()
    assert anc[6].tolist() == [1, 1, 0, 0, 1, 0, 1]
    assert anc[5].tolist() == [1, 0, 1, 0, 0, 1, 0]
    assert tree_position_ids(parents, 10).tolist() == [[10, 11, 11, 12, 12, 12, 13]]
    paths = retrieve_indices(parents).tolist()
    assert sorted(paths) == sorted([[0, 1, 3, -1], [0, 2, 5, -1], [0, 1, 4, 6]])
    mask = tree_attention_mask(parents, 3, torch.float32)
    assert mask.shape == (1, 1, 7, 10) and mask.dtype == torch.float32
    assert (mask[0, 0, :, :3] == 0).all()  # prefix visible to all
    assert mask[0, 0, 6, 3 + 2] == torch.finfo(torch.float32).min  # node 6 cannot see node 2
    assert mask[0, 0, 6, 3 + 4] == 0


@settings(max_examples=200, deadline=None)
@given(trees())
def test_every_node_sees_exactly_its_ancestors_and_itself(parents):
    check_parents(parents)
    anc = ancestor_mask(parents)
    p = parents.tolist()
    for i in range(len(p)):
        assert set(anc[i].nonzero().flatten().tolist()) == ancestors_by_walking(p, i)
    mask = tree_attention_mask(parents, 5, torch.float16)
    assert ((mask[0, 0, :, 5:] == 0) == anc).all()
    assert (tree_depth(parents) == anc.sum(1) - 1).all()


@settings(max_examples=200, deadline=None)
@given(trees())
def test_retrieve_paths_are_root_to_leaf_paths(parents):
    p = parents.tolist()
    leaves = set(range(len(p))) - set(p[1:])
    got = []
    for row in retrieve_indices(parents).tolist():
        path = [x for x in row if x >= 0]
        assert row[len(path):] == [-1] * (len(row) - len(path))  # padding only at the end
        got.append(path)
    expected = []
    for leaf in leaves:
        path = [leaf]
        while p[path[-1]] >= 0:
            path.append(p[path[-1]])
        expected.append(path[::-1])
    assert sorted(got) == sorted(expected)


@settings(max_examples=200, deadline=None)
@given(trees(), st.integers(0, 3))
def test_buffers_built_with_a_depth_bound_need_no_host_read_and_agree(parents, extra):
    """With a bound on the depth known ahead (a step's dynamic tree), the same depths and ancestors;
    ``root_paths`` holds every node's path, the leaves' rows being the root-to-leaf paths."""
    exact = TreeBuffers.build(parents)
    levels = exact.max_depth + extra
    bound = TreeBuffers.build(parents, levels)
    assert torch.equal(bound.depth, exact.depth) and torch.equal(bound.visible, exact.visible)
    assert bound.retrieve.shape == (parents.numel(), levels + 1)
    rows = {tuple(x for x in row if x >= 0) for row in bound.retrieve.tolist()}
    for i, row in enumerate(root_paths(parents, exact.depth, levels).tolist()):
        path = [x for x in row if x >= 0]
        assert path[-1] == i and set(path) == ancestors_by_walking(parents.tolist(), i)
    assert {tuple(x for x in row if x >= 0) for row in exact.retrieve.tolist()} <= rows


def test_check_parents_rejects_bad_trees():
    import pytest

    for bad in ([0, 0], [-1, -1], [-1, 1], [-1, 0, 3, 0]):
        with pytest.raises(ValueError):
            check_parents(torch.tensor(bad))


def test_published_medusa_tree():
    shape = mc_sim_7b_63()
    assert len(MC_SIM_7B_63) == 63 and shape.size == 64 and shape.depth == 4
    # node order is by depth, so parents precede children
    check_parents(shape.parents)


def test_chain_and_static_shapes():
    c = chain(3)
    assert c.parents.tolist() == [-1, 0, 1, 2] and c.ranks.tolist() == [0, 0, 0, 0]
    s = StaticShape([(1, 0)])  # the missing prefix (1,) is added
    assert s.paths == [(1,), (1, 0)] and s.parents.tolist() == [-1, 0, 1] and s.ranks.tolist() == [0, 1, 0]


def test_tree_from_measured_accuracy_prefers_likely_paths():
    acc = [[0.8, 0.1, 0.05], [0.6, 0.2, 0.1], [0.5, 0.1, 0.1]]
    shape = from_accuracies(acc, num_nodes=4)
    # expected gains: (0)=.8, (0,0)=.48, (0,0,0)=.24, (0,1)=.16, (1)=.1 -> the best four
    assert set(shape.paths) == {(0,), (0, 0), (0, 0, 0), (0, 1)}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=1, max_size=12))
def test_static_shapes_are_closed_under_prefixes(paths):
    """The prefix closure stops at the first prefix already present (linear in the paths' size);
    it must still add every missing prefix, whatever the order the paths come in."""
    want = {tuple(p[:i]) for p in paths for i in range(1, len(p) + 1)}
    shape = StaticShape([tuple(p) for p in paths])
    assert set(shape.paths) == want and shape.size == len(want) + 1
    check_parents(shape.parents)
    for i, p in enumerate(shape.paths, start=1):  # each node's parent is its path minus the last rank
        parent = shape.parents[i].item()
        assert (shape.paths[parent - 1] if parent else ()) == p[:-1] and shape.ranks[i].item() == p[-1]
