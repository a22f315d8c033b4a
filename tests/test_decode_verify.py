import torch

from headway.decode.shapes import StaticShape
from headway.decode.tree import TreeBuffers
from headway.decode.verify import stack_trees, verify_greedy

V = 10


def verify_one(tokens, buffers, logits):
    """``verify_greedy`` of one tree (a batch of one)."""
    return verify_greedy(tokens[None], buffers.parents[None], buffers.retrieve[None], logits[None])[0]


def logits_predicting(next_token):
    """Stub target: at node i its argmax is next_token[i]."""
    out = torch.zeros(len(next_token), V)
    out[torch.arange(len(next_token)), torch.tensor(next_token)] = 5.0
    return out


# root -> a(1) -> c(3);  root -> b(2) -> d(4) -> e(5)
PARENTS = torch.tensor([-1, 0, 0, 1, 2, 4])
TOKENS = torch.tensor([9, 1, 2, 3, 4, 5])
B = TreeBuffers.build(PARENTS)


def test_never_accepts():
    v = verify_one(TOKENS, B, logits_predicting([7, 7, 7, 7, 7, 7]))
    assert v.nodes.tolist() == [0] and int(v.bonus) == 7 and v.accepted == 0


def test_accepts_longest_path_and_bonus_from_last_node():
    # target wants 2 after the root, then 4, then 5, then 8: the b-d-e path, bonus 8
    v = verify_one(TOKENS, B, logits_predicting([2, 3, 4, 0, 5, 8]))
    assert v.nodes.tolist() == [0, 2, 4, 5] and int(v.bonus) == 8 and v.accepted == 3


def test_partial_path():
    # root -> 1 accepted, then the target wants 6, not 3
    v = verify_one(TOKENS, B, logits_predicting([1, 6, 0, 0, 0, 0]))
    assert v.nodes.tolist() == [0, 1] and int(v.bonus) == 6


def test_child_only_counts_when_parent_accepted():
    # node 3 matches node 1's prediction, but node 1 itself is rejected
    v = verify_one(TOKENS, B, logits_predicting([7, 3, 0, 0, 0, 0]))
    assert v.nodes.tolist() == [0] and int(v.bonus) == 7


def test_static_shape_buffers_work_with_verify():
    shape = StaticShape([(0,), (1,), (0, 0)])
    tokens = torch.tensor([9, 4, 5, 6])
    v = verify_one(tokens, shape.buffers, logits_predicting([4, 6, 0, 2]))
    assert v.nodes.tolist() == [0, 1, 3] and int(v.bonus) == 2


def test_a_batch_of_trees_is_verified_in_one_pass_as_each_alone():
    """Rows of different trees (padded: ``stack_trees``) and of one shared shape get the verdicts each
    tree gets alone."""
    chain = TreeBuffers.build(torch.tensor([-1, 0, 1]))
    rows = [(TOKENS, B, [2, 3, 4, 0, 5, 8]), (torch.tensor([9, 7, 8]), chain, [7, 8, 1]),
            (TOKENS, B, [1, 6, 0, 0, 0, 0]), (torch.tensor([9, 7, 8]), chain, [7, 3, 1])]
    N = max(t.numel() for t, _, _ in rows)
    tokens = torch.zeros(len(rows), N, dtype=torch.long)
    logits = torch.zeros(len(rows), N, V)
    for i, (t, _, nxt) in enumerate(rows):
        tokens[i, :t.numel()] = t
        logits[i, :t.numel()] = logits_predicting(nxt)
    got = verify_greedy(tokens, *stack_trees([b for _, b, _ in rows]), logits)
    for v, (t, b, nxt) in zip(got, rows):
        want = verify_one(t, b, logits_predicting(nxt))
        assert v.nodes.tolist() == want.nodes.tolist() and int(v.bonus) == int(want.bonus)
    assert [v.nodes.tolist() for v in got] == [[0, 2, 4, 5], [0, 1, 2], [0, 1], [0, 1]]
    shared = verify_greedy(torch.stack([TOKENS, TOKENS]), *stack_trees([B, B]),
                           torch.stack([logits_predicting([2, 3, 4, 0, 5, 8]), logits_predicting([7] * 6)]))
    assert [v.nodes.tolist() for v in shared] == [[0, 2, 4, 5], [0]] and [int(v.bonus) for v in shared] == [8, 7]
