"""The built-in chat prompt corpus, as the package ships it (``headway/data/corpora/chat.jsonl.gz``):
the prompts the generator wrote before it left the package, checksummed, split by task family."""

import hashlib
import re
import shutil
from collections import Counter

import pytest

from headway.data import chat_corpus as cc
from headway.data.errors import DataError
from headway.data.samples import Sample
from headway.data.sources import read_samples

ID = re.compile(r"chat:(train|extra|heldout|test):([a-z_]+):(\d+)")


def _norm(text: str) -> str:
    return " ".join(re.sub(r"\W+", " ", text.lower()).split())


@pytest.fixture(scope="module")
def train():
    return cc.chat_prompts("train")


@pytest.fixture(scope="module")
def heldout():
    return cc.chat_prompts("heldout")


def test_the_shipped_prompts_are_the_ones_distilled_datasets_were_made_from(train, heldout):
    """Frozen from the generator's output on Python 3.11.7: these digests are those of the prompts
    the generator wrote there (train and extra changed with the Python version; the file does not)."""
    extra = cc.chat_prompts("extra")
    assert (len(train), len(extra), len(heldout), len(cc.chat_prompts("dev"))) == (3108, 2814, 330, 120)
    assert [(p.id, p.text) for p in train[:2]] == [
        ("chat:train:explain_science:0", "Give a clear, accurate explanation of plate tectonics."),
        ("chat:train:howto:0", "my flatmate says there's a trick to make a simple web page with HTML. Is there?")]
    assert (train[-1].id, train[-1].text) == ("chat:train:quiz:83",
                                              "Create 4 flashcards (question and answer) to help me revise curling.")
    assert (extra[1].id, extra[1].text) == ("chat:extra:howto:0", "Can you explain how to repot a houseplant?")
    assert cc.chat_prompts("dev")[0].text == "Write a short essay comparing online courses and classroom courses."
    both = hashlib.sha256(repr([(p.id, p.text) for p in train + extra]).encode()).hexdigest()
    assert both[:16] == "0719da45cbbc5fd2", both[:16]
    held = hashlib.sha256("\n".join(p.id + "\t" + p.text for p in heldout).encode()).hexdigest()
    assert held[:16] == "86b9a4e4ba1af73c", held[:16]  # the benchmark prompts, as pinned before the freeze


def test_a_damaged_file_is_refused_saying_to_reinstall(tmp_path):
    shutil.copy(cc.MANIFEST, tmp_path / "chat.json")
    data = bytearray((cc.CORPORA / "chat.jsonl.gz").read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit
    (tmp_path / "chat.jsonl.gz").write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"chat.jsonl.gz: the built-in chat corpus is damaged \(sha256 [0-9a-f]{16}"
                                        r"\.\.\., expected 8af5799aa32d5dd7\.\.\.\); reinstall headway"):
        cc._corpus(tmp_path / "chat.json")
    (tmp_path / "chat.jsonl.gz").unlink()
    with pytest.raises(DataError, match="damaged .*reinstall"):
        cc._corpus(tmp_path / "chat.json")
    assert len(cc._corpus()[0]["train"]) == 3108  # the shipped one is intact


def test_sizes_and_family_balance(train, heldout):
    counts = Counter(p.family for p in train)
    assert len(counts) == 37 and max(counts.values()) <= 0.08 * len(train), counts.most_common(3)
    assert len(set(p.family for p in heldout)) == 6
    assert cc.family_counts("train") == dict(counts)
    assert sum(cc.family_counts("heldout").values()) == len(heldout)


def test_splits_share_no_prompt_or_family(train, heldout):
    extra = cc.chat_prompts("extra")
    assert not {p.family for p in train} & {p.family for p in heldout}
    assert {p.family for p in extra} == {p.family for p in train}
    keys = [{_norm(p.text) for p in s} for s in (train, extra, heldout)]
    assert not keys[0] & keys[1] and not keys[0] & keys[2] and not keys[1] & keys[2]


def test_no_duplicates_and_well_formed_ids(train, heldout):
    for split, prompts in (("train", train), ("heldout", heldout)):
        assert len({_norm(p.text) for p in prompts}) == len(prompts), split
        assert len({p.id for p in prompts}) == len(prompts)
        for p in prompts:
            m = ID.fullmatch(p.id)
            assert m and m.group(1) == split and m.group(2) == p.family
        for fam, n in Counter(p.family for p in prompts).items():  # indices within a family are 0..n-1
            assert sorted(int(p.id.rsplit(":", 1)[1]) for p in prompts if p.family == fam) == list(range(n))


def test_interleaved_so_every_prefix_is_varied(train):
    n_fam = len(set(p.family for p in train))
    assert len({p.family for p in train[:n_fam]}) == n_fam  # round-robin: the first round has every family
    for start in range(0, len(train) - 50, 250):
        assert len({p.family for p in train[start:start + 50]}) >= 10


def test_read_samples_chat_source_is_a_stable_prefix(train):
    s = read_samples("chat:train", limit=50).samples
    assert len(s) == 50 and all(isinstance(x, Sample) and not x.is_chat for x in s)
    assert [(x.id, x.prompt, x.meta["family"]) for x in s] == [(p.id, p.text, p.family) for p in train[:50]]
    assert read_samples("chat:train", limit=50, seed=123).samples == s  # the seed changes nothing
    assert len(read_samples("chat:heldout").samples) == 330
    with pytest.raises(DataError, match="chat:train or chat:extra or chat:heldout or chat:dev or chat:test"):
        read_samples("chat:final")
    with pytest.raises(DataError, match="unknown chat corpus split"):
        cc.chat_prompts("final")


def test_dev_is_the_heldout_tail_that_bench_prefixes_never_reach(heldout):
    dev = read_samples("chat:dev").samples
    assert len(dev) == cc.dev_size() == 120 and [s.prompt for s in dev] == [p.text for p in heldout[-120:]]
    assert all(s.id.startswith("chat:heldout:") for s in dev)
    assert {s.meta["family"] for s in dev} == {p.family for p in heldout}
    bench = read_samples("chat:heldout", limit=len(heldout) - 120).samples
    assert not {s.prompt for s in bench} & {s.prompt for s in dev}
    assert [s.prompt for s in read_samples("chat:dev", limit=5).samples] == [s.prompt for s in dev[:5]]



# ---- the test split: new prompts no choice has seen, and the other splits as they were before it


def test_adding_the_test_split_left_every_other_split_as_it_was(train, heldout):
    """The main file is byte for byte the one distilled datasets were made from (its sha256 pinned
    before the test split existed), and dev, a view of it, holds the prompts it held."""
    data = (cc.CORPORA / "chat.jsonl.gz").read_bytes()
    assert hashlib.sha256(data).hexdigest()[:16] == "8af5799aa32d5dd7"
    assert {s: len(cc.chat_prompts(s)) for s in ("train", "extra", "heldout", "dev")} == \
        {"train": 3108, "extra": 2814, "heldout": 330, "dev": 120}
    dev = hashlib.sha256("\n".join(p.id + "\t" + p.text for p in cc.chat_prompts("dev")).encode()).hexdigest()
    assert dev[:16] == "0eccb100132529d0", dev[:16]
    assert all(":test:" not in p.id for s in cc.SPLITS for p in cc.chat_prompts(s))


def test_the_test_split_is_new_prompts_of_the_heldout_families(train, heldout):
    test = cc.chat_prompts("test")
    assert len(test) == 300 and Counter(p.family for p in test) == {f: 50 for f in {p.family for p in heldout}}
    digest = hashlib.sha256("\n".join(p.id + "\t" + p.text for p in test).encode()).hexdigest()
    assert digest[:16] == "c5db67e80b7e77f7", digest[:16]
    keys = {_norm(p.text) for p in test}
    assert len(keys) == len(test)  # no duplicates
    for split in ("train", "extra", "heldout"):
        assert not keys & {_norm(p.text) for p in cc.chat_prompts(split)}, split
    for p in test:
        m = ID.fullmatch(p.id)
        assert m and m.group(1) == "test" and m.group(2) == p.family
    assert len({p.family for p in test[:6]}) == 6  # interleaved round-robin, as every split


def test_chat_test_is_a_prompt_source_like_chat_dev():
    s = read_samples("chat:test", limit=4).samples
    assert [x.id for x in s] == [p.id for p in cc.chat_prompts("test")[:4]]
    assert all(x.prompt and x.meta["family"] for x in s)
    assert cc.family_counts("test") == {f: 50 for f in cc.family_counts("heldout")}


def test_a_damaged_test_file_is_refused_saying_to_reinstall(tmp_path):
    shutil.copy(cc.MANIFEST, tmp_path / "chat.json")
    data = bytearray((cc.CORPORA / "chat-test.jsonl.gz").read_bytes())
    data[len(data) // 2] ^= 0x01
    (tmp_path / "chat-test.jsonl.gz").write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"chat-test.jsonl.gz: the built-in chat corpus is damaged \(sha256 .*reinstall"):
        cc._test_split(tmp_path / "chat.json")
    (tmp_path / "chat-test.jsonl.gz").unlink()
    with pytest.raises(DataError, match="damaged .*reinstall"):
        cc._test_split(tmp_path / "chat.json")


def test_no_recipe_or_script_reads_the_test_split():
    """Choices are made on chat:dev: no shipped recipe, tune call or ablation script names chat:test
    (``headway tune`` refuses it: tests/test_bench_eval_cli.py)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = [f for folder in ("configs", "benchmarks", "examples", "experiments") for f in (root / folder).rglob("*")
             if f.is_file() and f.suffix in (".yaml", ".yml", ".py", ".sh")]
    assert len(files) > 20
    assert [str(f.relative_to(root)) for f in files if "chat:test" in f.read_text(errors="replace")] == []
