import torch

from headway.decode.shapes import StaticShape
from headway.decode.tree import TreeBuffers
from headway.decode.verify import verify_greedy

V = 10


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
    v = verify_greedy(TOKENS, B, logits_predicting([7, 7, 7, 7, 7, 7]))
    assert v.nodes.tolist() == [0] and int(v.bonus) == 7 and v.accepted == 0


def test_accepts_longest_path_and_bonus_from_last_node():
    # target wants 2 after the root, then 4, then 5, then 8: the b-d-e path, bonus 8
    v = verify_greedy(TOKENS, B, logits_predicting([2, 3, 4, 0, 5, 8]))
    assert v.nodes.tolist() == [0, 2, 4, 5] and int(v.bonus) == 8 and v.accepted == 3


def test_partial_path():
    # root -> 1 accepted, then the target wants 6, not 3
    v = verify_greedy(TOKENS, B, logits_predicting([1, 6, 0, 0, 0, 0]))
    assert v.nodes.tolist() == [0, 1] and int(v.bonus) == 6


def test_child_only_counts_when_parent_accepted():
    # node 3 matches node 1's prediction, but node 1 itself is rejected
    v = verify_greedy(TOKENS, B, logits_predicting([7, 3, 0, 0, 0, 0]))
    assert v.nodes.tolist() == [0] and int(v.bonus) == 7


def test_static_shape_buffers_work_with_verify():
    shape = StaticShape([(0,), (1,), (0, 0)])
    tokens = torch.tensor([9, 4, 5, 6])
    v = verify_greedy(tokens, shape.buffers, logits_predicting([4, 6, 0, 2]))
    assert v.nodes.tolist() == [0, 1, 3] and int(v.bonus) == 2
