"""The decoder's arguments are checked up front, with the rule in the message: directly
(``check_decode_args``, tree parsing) and through ``Speculator.generate`` and the CLI."""

import math
import re

import pytest
import torch

from headway.cli import main
from headway.decode import Speculator
from headway.decode.args import DecodeError, check_decode_args
from headway.decode.shapes import (MAX_DYNAMIC_TOP_K, MAX_TREE_DEPTH, MAX_TREE_NODES, DynamicShape, StaticShape,
                                   TreeSpecError, chain, parse_shape)
from headway.errors import HeadwayError
from headway.heads import MedusaHeads
from headway.testing import tiny_target

BAD = [  # (arguments, words the message must hold)
    (dict(max_new_tokens=0), "max_new_tokens must be at least 1"),
    (dict(max_new_tokens=-5), "max_new_tokens must be at least 1, got -5"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be a whole number"),
    (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
    (dict(temperature=math.inf), "temperature must be a finite number >= 0"),
    (dict(temperature=math.nan), "temperature must be a finite number >= 0"),
    (dict(top_p=0.0), "top_p must be in (0, 1]"),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
    (dict(top_p=math.nan), "top_p must be in (0, 1]"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(typical=(0.0, 0.3)), "threshold (posterior_threshold) must be in (0, 1]"),
    (dict(typical=(1.5, 0.3)), "threshold (posterior_threshold) must be in (0, 1]"),
    (dict(typical=(0.09, -1.0)), "alpha (posterior_alpha) must be a finite number > 0"),
    (dict(typical=(0.09, math.inf)), "alpha (posterior_alpha) must be a finite number > 0"),
]


@pytest.mark.parametrize("kw,words", BAD)
def test_check_decode_args_names_the_rule(kw, words):
    with pytest.raises(DecodeError) as e:
        check_decode_args(**{"max_new_tokens": 8, **kw})
    assert words in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, HeadwayError) and isinstance(e.value, ValueError)


def test_check_decode_args_accepts_the_edges():
    check_decode_args(1)
    check_decode_args(1, temperature=0.0, top_p=1.0, top_k=0)
    check_decode_args(5, temperature=2.0, top_p=1e-6, top_k=50, typical=(1.0, 0.3))
    check_decode_args(10, prompt_tokens=502, max_positions=512)  # exactly fills the context


def test_check_decode_args_refuses_what_cannot_fit_the_context():
    with pytest.raises(DecodeError) as e:
        check_decode_args(50, prompt_tokens=502, max_positions=512)
    msg = str(e.value)
    assert "502 tokens" in msg and "max_new_tokens is 50" in msg and "context of 512" in msg
    assert "lower max_new_tokens to 10" in msg
    with pytest.raises(DecodeError, match="shorten the prompt"):
        check_decode_args(1, prompt_tokens=512, max_positions=512)


# ---------------------------------------------------------------------------------------------
# Tree specs


@pytest.mark.parametrize("spec,words", [
    ("chain-0", "at least one draft"),
    ("chain--2", "at least one draft"),
    ("chainfoo", "expected chain-N"),
    ("fork-0", "at least one draft"),
    ("fork", "expected fork-N"),
    ("fork-2x", "expected fork-N"),
    ("dynamic-", "expected dynamic-TOPK-DEPTH-TOTAL"),
    ("dynamic-a-5-16", "expected dynamic-TOPK-DEPTH-TOTAL"),
    ("dynamic-4-5-16-3", "expected dynamic-TOPK-DEPTH-TOTAL"),
    ("dynamicfoo", "expected dynamic-TOPK-DEPTH-TOTAL"),
    ("dynamic-0-5-16", "top_k >= 1"),
    ("dynamic-4-0-16", "depth >= 1"),
    ("dynamic-4-5-1", "total_tokens >= 2"),
    ("static:[]", "non-empty JSON list"),
    ("static:[[0],[]]", "non-empty JSON list"),
    ("static:[[0],[0,-1]]", "node [0,-1] has rank -1; a rank is a whole number >= 0"),
    # #46: a node whose parent is missing was accepted (the parent added silently: another tree)
    ("static:[[0,0]]", "node [0,0] has no parent: list [0] too"),
    ("static:[[0],[5,0]]", "node [5,0] has no parent: list [5] too"),
    ("static:[[0],[1],[1,2,0]]", "node [1,2,0] has no parent: list [1,2] too"),
    ("static:[[0],[0.5]]", "node [0.5] has rank 0.5"),
    ("static:[[0],[true]]", "node [true] has rank true"),
    ('static:[[0],["1"]]', 'node ["1"] has rank "1"'),
    ("static:[[0],[1],[0]]", "node [0] is listed twice"),
    ("bogus", "unknown tree"),
])
def test_malformed_tree_specs_are_clear_errors(spec, words):
    with pytest.raises(TreeSpecError) as e:
        parse_shape(spec)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_fork_spec_reads_back():
    from headway.bench.tune import shape_spec
    from headway.decode.shapes import is_fork

    shape = parse_shape("fork-3")
    assert shape.parents.tolist() == [-1, 0, 0, 1, 1, 3, 3] and shape.ranks.tolist() == [0, 0, 1, 0, 1, 0, 1]
    assert is_fork(shape) and is_fork(parse_shape("static:[[0],[1],[0,0],[0,1]]")) and is_fork(shape.truncated(2))
    assert not is_fork(parse_shape("chain-3")) and not is_fork(parse_shape("static:[[0],[1],[0,0]]"))
    assert shape_spec(shape) == "fork-3" and shape_spec(shape.truncated(1)) == "fork-1"


def test_tree_specs_are_bounded_and_refused_at_once(monkeypatch):
    """chain-N used to build its N(N+1)/2 path entries and close them under prefixes (cubic) before
    the decoder truncated the tree to the heads' depth: chain-4000 took minutes, chain-100000 ran
    out of memory. Now anything over the limits is refused before it is built."""
    from headway.decode import shapes

    built: list[str] = []

    class Spy(StaticShape):
        def __post_init__(self) -> None:
            built.append(self.name)
            super().__post_init__()

    monkeypatch.setattr(shapes, "StaticShape", Spy)
    for spec, words in [("chain-1000", f"depth 1000 is over the limit of {MAX_TREE_DEPTH}"),
                        ("chain-4000", f"depth 4000 is over the limit of {MAX_TREE_DEPTH}"),
                        ("chain-100000", "depth 100000"),
                        (f"dynamic-4-{MAX_TREE_DEPTH + 1}-16", "depth"),
                        (f"dynamic-4-5-{MAX_TREE_NODES + 1}", f"over the limit of {MAX_TREE_NODES}"),
                        (f"dynamic-{MAX_DYNAMIC_TOP_K + 1}-5-16", "top_k")]:
        with pytest.raises(TreeSpecError, match="over the limit") as e:
            parse_shape(spec)
        assert words in str(e.value)
    assert built == []  # refused from the numbers: no over-limit tree was started
    for spec, words in [("static:[" + ",".join(f"[{r}]" for r in range(MAX_TREE_NODES)) + "]",
                         f"nodes (root included) {MAX_TREE_NODES + 1}"),
                        ("static:[[" + ",".join(["0"] * (MAX_TREE_DEPTH + 1)) + "]]", "depth")]:
        with pytest.raises(TreeSpecError, match="over the limit") as e:
            parse_shape(spec)
        assert words in str(e.value)
    with pytest.raises(TreeSpecError):
        chain(MAX_TREE_DEPTH + 1)
    with pytest.raises(TreeSpecError):
        DynamicShape(4, 5, MAX_TREE_NODES + 1)


def test_a_static_tree_stops_reading_paths_at_the_first_over_the_limit():
    """Paths are checked as they are read: a tree with far more paths than the node limit is refused
    at the path that crosses it (the rest is never closed under prefixes), and a path deeper than
    the limit is refused before its prefixes are made."""
    read = 0

    def paths(n: int, path=lambda i: (i,)):
        nonlocal read
        for i in range(n):
            read += 1
            yield path(i)

    with pytest.raises(TreeSpecError, match=f"nodes \\(root included\\) {MAX_TREE_NODES + 1}"):
        StaticShape(paths(100 * MAX_TREE_NODES))  # type: ignore[arg-type]
    assert read == MAX_TREE_NODES  # the root and MAX_TREE_NODES one-node paths: one too many
    read = 0
    with pytest.raises(TreeSpecError, match="depth 100000"):
        StaticShape(paths(10, lambda i: (0,) * (1 if i < 3 else 100_000)))  # type: ignore[arg-type]
    assert read == 4


def test_the_largest_allowed_trees_build():
    deep = parse_shape(f"chain-{MAX_TREE_DEPTH}")
    assert deep.depth == MAX_TREE_DEPTH and deep.size == MAX_TREE_DEPTH + 1
    assert deep.parents.tolist() == [-1] + list(range(MAX_TREE_DEPTH))
    wide = StaticShape([(r,) for r in range(MAX_TREE_NODES - 1)])
    assert wide.size == MAX_TREE_NODES and wide.parents.tolist() == [-1] + [0] * (MAX_TREE_NODES - 1)
    # many long paths sharing prefixes: the prefix closure stops at the first known prefix
    bushy = StaticShape([(0,) * (MAX_TREE_DEPTH - 1) + (r,) for r in range(MAX_TREE_NODES - MAX_TREE_DEPTH)])
    assert bushy.size == MAX_TREE_NODES and bushy.depth == MAX_TREE_DEPTH
    spine = MAX_TREE_DEPTH - 1  # the node at depth 63 every leaf hangs from
    assert bushy.parents[spine + 1:].tolist() == [spine] * (MAX_TREE_NODES - MAX_TREE_DEPTH)
    assert chain(3).paths == [(0,), (0, 0), (0, 0, 0)] and parse_shape("chain").paths == chain(4).paths


# ---------------------------------------------------------------------------------------------
# Through Speculator.generate


@pytest.fixture(scope="module")
def spec():
    model, tok = tiny_target("llama")
    torch.manual_seed(0)
    return Speculator(model, tok, MedusaHeads.for_target(model, num_heads=3), tree="chain-3")


@pytest.mark.parametrize("kw,words", [(kw, w) for kw, w in BAD if "typical" not in kw])
def test_generate_checks_its_arguments_before_decoding(spec, monkeypatch, kw, words):
    def no_decoding(*a, **k):
        raise AssertionError("decoding started")

    monkeypatch.setattr(spec, "start", no_decoding)
    with pytest.raises(DecodeError, match=re.escape(words)):
        spec.generate([5, 17, 33], **{"max_new_tokens": 8, **kw})
    with pytest.raises(DecodeError):  # streaming too, when the iterator is made, not at the first step
        spec.generate([5, 17, 33], stream=True, **{"max_new_tokens": 8, **kw})


def test_generate_with_typical_acceptance_checks_its_parameters(spec):
    bad = Speculator(spec.target, spec.tokenizer, spec.heads, tree="chain-3", typical=(0.0, 0.3))
    with pytest.raises(DecodeError, match=r"posterior_threshold"):
        bad.generate([5, 17, 33], max_new_tokens=4, temperature=1.0, seed=0)


def test_generate_emits_exactly_max_new_tokens(spec):
    assert len(spec.generate([5, 17, 33], max_new_tokens=1).ids) == 1
    assert len(spec.generate([5, 17, 33], max_new_tokens=7).ids) == 7


def test_a_prompt_that_cannot_fit_is_refused_before_decoding(spec):
    limit = spec.target.config.max_position_embeddings
    ids = [5 + i % 300 for i in range(limit - 5)]
    with pytest.raises(DecodeError) as e:
        spec.generate(ids, max_new_tokens=10)  # used to return 5 tokens without a word
    msg = str(e.value)
    assert f"{limit - 5} tokens" in msg and "max_new_tokens is 10" in msg and f"context of {limit}" in msg
    out = spec.generate(ids, max_new_tokens=5)  # fits exactly: the tree shrinks near the end
    assert len(out.ids) == 5 and out.stats.stopped_by == "length"


def test_a_tree_spec_error_reaches_the_speculator(spec):
    for tree in ("chain-0", "chain-100000", "dynamic-4-5-1"):
        with pytest.raises(TreeSpecError):
            Speculator(spec.target, spec.tokenizer, spec.heads, tree=tree)


# ---------------------------------------------------------------------------------------------
# The CLI: one line, before any model is loaded (the target below does not exist)


@pytest.mark.parametrize("args,words", [
    (["--max-new-tokens", "0"], "max_new_tokens must be at least 1"),
    (["--max-new-tokens", "-5"], "max_new_tokens must be at least 1"),
    (["--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-k", "-3"], "top_k must be >= 0"),
    (["--typical", "--temperature", "1", "--posterior-threshold", "0"], "posterior_threshold"),
    (["--tree", "chain-0"], "at least one draft"),
    (["--tree", "chain-100000"], "over the limit of 64"),
    (["--tree", "dynamic-4-x"], "expected dynamic-TOPK-DEPTH-TOTAL"),
])
def test_generate_cli_refuses_bad_arguments_in_one_line(capsys, args, words):
    rc = main(["generate", "--target", "/no/such/target", "--heads", "/no/such/heads", "--prompt", "x", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("headway generate: error:") and words in err[0]


@pytest.mark.parametrize("command,args,words", [
    ("chat", ["--max-new-tokens", "0"], "max_new_tokens must be at least 1"),
    ("chat", ["--temperature", "-2"], "temperature must be a finite number >= 0"),
    ("chat", ["--tree", "chain--2"], "at least one draft"),
    ("bench", ["--tree", "chain-4000"], "over the limit of 64"),
    ("tune", ["--max-new-tokens", "0"], "max_new_tokens must be at least 1"),
    ("tune", ["--temperatures", "-1"], "temperature must be a finite number >= 0"),
])
def test_other_decode_commands_check_the_same_rules(capsys, command, args, words):
    rc = main([command, "--target", "/no/such/target", "--heads", "/no/such/heads", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"headway {command}: error:") and words in err[0], err


def test_the_command_configs_refuse_what_the_command_line_cannot_spell():
    from headway.bench.run import BenchConfig
    from headway.decode.cli import ChatConfig, GenerateConfig
    from headway.bench.tune import TuneConfig

    with pytest.raises(DecodeError, match="temperature must be a finite number"):
        BenchConfig(target="t", heads=["h"], temperature=[0.0, math.inf])
    with pytest.raises(DecodeError, match="temperature must be a finite number"):
        TuneConfig(target="t", heads="h", temperatures=[math.nan])
    with pytest.raises(DecodeError, match="temperature must be a finite number"):
        GenerateConfig(target="t", heads="h", temperature=math.inf)
    with pytest.raises(DecodeError, match="top_p must be in"):
        ChatConfig(target="t", heads="h", top_p=math.nan)
