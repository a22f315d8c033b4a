"""The ``Proposer`` protocol (decode/proposers.py) is the whole contract the decoder drives: one
class per head kind satisfies it, with the protocol's signatures, and ``Speculator`` types its state
with it."""

import inspect
import typing

import pytest

from headway.decode.proposers import (DFlashProposer, EagleProposer, MedusaProposer, Proposer, RowsProposer,
                                      make_proposer)
from headway.decode.speculator import Speculator
from headway.decode.step import Batch
from headway.heads import DFlashDrafter, Eagle1Drafter, Eagle3Drafter, MedusaHeads

METHODS = ("prefill", "accept", "root_logprobs", "expand", "to_target_ids", "end_tree", "select", "fork")
ATTRIBUTES = ("max_depth", "draft_vocab_size", "feature_layers", "temperatures")


def _members(proto: type) -> set[str]:
    return {n for n in vars(proto) if not n.startswith("_")} | set(getattr(proto, "__annotations__", {}))


def test_the_protocol_is_the_whole_contract():
    assert _members(Proposer) == {*METHODS, *ATTRIBUTES}


@pytest.mark.parametrize("cls", [MedusaProposer, EagleProposer, DFlashProposer, RowsProposer])
def test_each_proposer_has_the_protocol_signatures(cls):
    for name in METHODS:
        want, got = inspect.signature(getattr(Proposer, name)), inspect.signature(getattr(cls, name))
        assert list(got.parameters) == list(want.parameters), (cls.__name__, name)
        for p in want.parameters.values():
            assert got.parameters[p.name].annotation == p.annotation, (cls.__name__, name, p.name)
        returns = want.return_annotation  # fork returns its own class, a Proposer
        assert got.return_annotation == (cls.__name__ if returns == "Proposer" else returns), (cls.__name__, name)


@pytest.mark.parametrize("make", [lambda m: MedusaHeads.for_target(m, num_heads=3),
                                  lambda m: Eagle1Drafter.for_target(m),
                                  lambda m: Eagle3Drafter.for_target(m, draft_vocab_size=100),
                                  lambda m: DFlashDrafter.for_target(m, mask_token_id=3, block_size=4, num_layers=1)],
                         ids=["medusa", "eagle1", "eagle3", "dflash"])
def test_made_proposers_and_their_forks_satisfy_it(tiny_llama, make):
    model, _ = tiny_llama
    proposer = make_proposer(make(model), max_depth=4)
    assert isinstance(proposer, Proposer)
    assert isinstance(proposer.fork(), Proposer)
    assert isinstance(RowsProposer([proposer, proposer.fork()]), Proposer)


def test_speculator_types_its_proposer_with_the_protocol():
    assert typing.get_type_hints(Batch)["proposer"] is Proposer
    for name in ("new_proposer", "new_batch_proposer"):
        assert inspect.signature(getattr(Speculator, name)).return_annotation == "Proposer"
