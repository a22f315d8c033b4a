"""Draft-vocabulary statistics: counts over loss-masked tokens, the reduced vocab and its mappings."""

import pytest
import torch

from headway.data.errors import DataError
from headway.data.vocab import draft_vocab, load_token_counts, save_token_counts, token_frequencies


def test_token_frequencies_count_only_masked_tokens():
    from datasets import Dataset

    ds = Dataset.from_list([{"input_ids": [5, 6, 7, 7], "loss_mask": [0, 1, 1, 1]},
                            {"input_ids": [7, 9], "loss_mask": [1, 0]}])
    counts = token_frequencies(ds, 10)
    assert counts.dtype == torch.int64 and counts.tolist() == [0, 0, 0, 0, 0, 0, 1, 3, 0, 0]
    assert token_frequencies(ds.select([1]), 10).tolist()[7] == 1  # respects selections
    with pytest.raises(DataError, match="outside the target vocabulary"):
        token_frequencies(ds, 7)


def test_draft_vocab_round_trip():
    torch.manual_seed(0)
    counts = torch.randint(0, 50, (1000,))
    counts[[3, 500, 999]] = 10_000  # surely in
    ids, d2t, t2d = draft_vocab(counts, 64)
    assert ids.dtype == d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.shape == (1000,)
    assert torch.all(ids[1:] > ids[:-1])  # sorted by target id
    assert torch.equal(torch.arange(64) + d2t, ids)  # draft id i -> target id i + d2t[i]
    assert torch.equal(torch.nonzero(t2d)[:, 0], ids)
    assert {3, 500, 999} <= set(ids.tolist())
    assert counts[ids].min() >= counts[~t2d].max()  # the most frequent ones
    # target -> draft through t2d: the draft id is the rank among kept tokens
    draft_of = torch.cumsum(t2d.long(), 0) - 1
    assert torch.equal(draft_of[ids], torch.arange(64))


def test_draft_vocab_ties_go_to_lower_ids_and_bounds():
    ids, d2t, _ = draft_vocab(torch.tensor([1, 5, 5, 5, 0]), 3)
    assert ids.tolist() == [1, 2, 3] and d2t.tolist() == [1, 1, 1]
    assert draft_vocab(torch.tensor([0, 0, 9]), 2)[0].tolist() == [0, 2]
    with pytest.raises(DataError):
        draft_vocab(torch.zeros(5, dtype=torch.long), 6)


def test_counts_file_round_trip(tmp_path):
    counts = torch.tensor([0, 4, 2], dtype=torch.int64)
    save_token_counts(tmp_path, counts)
    assert torch.equal(load_token_counts(tmp_path), counts)
    with pytest.raises(DataError, match="token_counts"):
        load_token_counts(tmp_path / "nowhere")
