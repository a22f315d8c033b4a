"""The built-in chat prompt corpus: big, varied, deduplicated, deterministic, split by task family."""

import hashlib
import json
import re
from collections import Counter

import pytest

from headway.data import chat_corpus as cc
from headway.data.errors import DataError
from headway.data.samples import Sample
from headway.data.sources import read_samples

ID = re.compile(r"chat:(train|heldout):([a-z_]+):(\d+)")


def _norm(text: str) -> str:
    return " ".join(re.sub(r"\W+", " ", text.lower()).split())


@pytest.fixture(scope="module")
def train():
    return cc.chat_prompts("train")


@pytest.fixture(scope="module")
def heldout():
    return cc.chat_prompts("heldout")


def test_sizes_and_family_balance(train, heldout):
    assert len(train) >= 2000 and len(heldout) >= 200
    counts = Counter(p.family for p in train)
    assert len(counts) >= 25
    assert max(counts.values()) <= 0.08 * len(train), counts.most_common(3)
    assert len(set(p.family for p in heldout)) >= 4
    assert cc.family_counts("train") == dict(counts)
    assert sum(cc.family_counts("heldout").values()) == len(heldout)


def test_splits_share_no_prompt_family_or_subject(train, heldout):
    assert not {p.family for p in train} & {p.family for p in heldout}
    assert not {_norm(p.text) for p in train} & {_norm(p.text) for p in heldout}
    train_subjects = {x.lower() for xs in cc.TRAIN_SUBJECTS.values() for x in xs}
    train_text = "\n".join(p.text.lower() for p in train)
    for xs in cc.HELDOUT_SUBJECTS.values():
        for x in xs:
            assert x.lower() not in train_subjects, x
            if " " in x:  # multi-word held-out subjects never occur in a train prompt
                assert x.lower() not in train_text, x


def test_no_duplicates_and_well_formed_ids(train, heldout):
    for split, prompts in (("train", train), ("heldout", heldout)):
        keys = [_norm(p.text) for p in prompts]
        assert len(set(keys)) == len(keys), split
        ids = [p.id(split) for p in prompts]
        assert len(set(ids)) == len(ids)
        for p, i in zip(prompts, ids):
            m = ID.fullmatch(i)
            assert m and m.group(1) == split and m.group(2) == p.family
        per_family = Counter(p.family for p in prompts)
        for fam, n in per_family.items():  # indices within a family are 0..n-1
            assert sorted(p.index for p in prompts if p.family == fam) == list(range(n))


def test_prompt_lengths_are_bounded_and_varied(train, heldout):
    for p in train + heldout:
        assert cc.MIN_CHARS <= len(p.text) <= cc.MAX_CHARS and p.text == p.text.strip(), p
        if p.family not in cc.VERBATIM_FAMILIES:  # no unfilled template slot
            assert not re.search(r"\{\w+\}", p.text), p
    lengths = [len(p.text) for p in train]
    assert sum(n < 80 for n in lengths) > 300 and sum(n > 300 for n in lengths) > 200  # one-liners and paragraphs


def test_deterministic(train, heldout):
    cc.chat_prompts.cache_clear()
    assert cc.chat_prompts("train") == train and cc.chat_prompts("heldout") == heldout


def test_heldout_is_pinned(heldout):
    """Held-out prompts are a benchmark: changing them makes old numbers incomparable. To change them on purpose,
    bump ``chat_corpus.SEED`` and update this digest (it does not depend on the Python version)."""
    digest = hashlib.sha256("\n".join(p.id("heldout") + "\t" + p.text for p in heldout).encode()).hexdigest()
    assert digest[:16] == "86b9a4e4ba1af73c", digest[:16]


def test_interleaved_so_every_prefix_is_varied(train):
    n_fam = len(set(p.family for p in train))
    assert len({p.family for p in train[:n_fam]}) == n_fam  # round-robin: the first round has every family
    for start in range(0, len(train) - 50, 250):
        assert len({p.family for p in train[start:start + 50]}) >= 10


def test_read_samples_chat_source_is_a_stable_prefix(train):
    s = read_samples("chat:train", limit=50).samples
    assert len(s) == 50 and all(isinstance(x, Sample) and not x.is_chat for x in s)
    assert [x.prompt for x in s] == [p.text for p in train[:50]]
    assert len({ID.fullmatch(x.id).group(2) for x in s}) >= 10
    assert read_samples("chat:train", limit=50, seed=123).samples == s  # the seed changes nothing
    assert len(read_samples("chat:heldout").samples) == len(cc.chat_prompts("heldout"))
    assert read_samples("chat:heldout", limit=3).samples[0].id.startswith("chat:heldout:")
    with pytest.raises(DataError, match="chat:train or chat:extra or chat:heldout"):
        read_samples("chat:test")
    with pytest.raises(ValueError, match="unknown chat corpus split"):
        cc.chat_prompts("test")


def test_write_jsonl_round_trips(tmp_path, heldout):
    path = tmp_path / "sub" / "heldout.jsonl"
    assert cc.write_jsonl(path, "heldout") == len(heldout)
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert rows[0] == {"id": heldout[0].id("heldout"), "prompt": heldout[0].text, "family": heldout[0].family}
    back = read_samples(str(path)).samples
    assert [(s.id, s.prompt) for s in back] == [(p.id("heldout"), p.text) for p in heldout]


def test_articles_and_plurals():
    assert cc._articles("a optician and a urban planner, a ultimate a unique a one-off a LED a UX") == \
        "an optician and an urban planner, an ultimate a unique a one-off an LED a UX"
    assert [cc._plural(x) for x in ("red fox", "wolf", "otter")] == ["red foxes", "wolves", "otters"]


def test_dev_is_the_heldout_tail_that_bench_prefixes_never_reach(heldout):
    """chat:dev (evaluation, calibration) and any benchmark prefix of chat:heldout shorter than
    len(heldout) - DEV_PROMPTS share no prompt; dev keeps the held-out ids and covers every family."""
    dev = read_samples("chat:dev").samples
    assert len(dev) == cc.DEV_PROMPTS and [s.prompt for s in dev] == [p.text for p in heldout[-cc.DEV_PROMPTS:]]
    assert all(s.id.startswith("chat:heldout:") for s in dev)
    assert {s.meta["family"] for s in dev} == {p.family for p in heldout}
    bench = read_samples("chat:heldout", limit=len(heldout) - cc.DEV_PROMPTS).samples
    assert not {s.prompt for s in bench} & {s.prompt for s in dev}
    assert [s.prompt for s in read_samples("chat:dev", limit=5).samples] == [s.prompt for s in dev[:5]]


def test_extra_is_more_of_the_train_families_and_never_a_train_or_heldout_prompt(train, heldout):
    extra = cc.chat_prompts("extra")
    assert len(extra) >= 2000
    assert {p.family for p in extra} == {p.family for p in train}
    seen_elsewhere = {_norm(p.text) for p in train} | {_norm(p.text) for p in heldout}
    texts = [_norm(p.text) for p in extra]
    assert len(set(texts)) == len(texts) and not set(texts) & seen_elsewhere
    assert max(Counter(p.family for p in extra).values()) <= cc.EXTRA_PER_FAMILY
    rows = read_samples("chat:extra", limit=5).samples
    assert [r.id for r in rows] == [p.id("extra") for p in extra[:5]]
    assert all(r.id.startswith("chat:extra:") for r in rows)
    assert cc.chat_prompts("train")[:50] == train[:50]  # adding the split left train as it was


def test_the_corpus_does_not_depend_on_what_was_imported_first(train):
    """torch replaces ``inspect.getfile`` when imported; the prompts must not notice."""
    import subprocess
    import sys

    import torch  # noqa: F401  (imported here, in this process, on purpose)

    code = ("import hashlib, sys\nfrom headway.data.chat_corpus import chat_prompts\n"
            "assert 'torch' not in sys.modules\n"
            "print(hashlib.sha256(repr([(p.id(s), p.text) for s in ('train', 'extra') for p in chat_prompts(s)])"
            ".encode()).hexdigest())")
    bare = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    here = hashlib.sha256(repr([(p.id(s), p.text) for s in ("train", "extra")
                                for p in cc.chat_prompts(s)]).encode()).hexdigest()
    assert bare == here
