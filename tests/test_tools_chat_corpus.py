"""tools/chat_corpus.py, the generator the shipped chat corpus was frozen from (not part of the package)."""

import hashlib
import importlib.util
import json
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = json.loads((ROOT / "headway" / "data" / "corpora" / "chat.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def cc():
    spec = importlib.util.spec_from_file_location("chat_corpus_tool", ROOT / "tools" / "chat_corpus.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def _norm(text: str) -> str:
    return " ".join(re.sub(r"\W+", " ", text.lower()).split())


@pytest.mark.skipif(platform.python_version() != SHIPPED["python"],
                    reason="the stdlib-derived train families follow the running Python's sources")
def test_the_generator_still_writes_the_shipped_prompts(cc, tmp_path):
    text = cc.frozen_bytes()[1]
    assert text["content_sha256"] == SHIPPED["content_sha256"] and text["splits"] == SHIPPED["splits"]
    assert cc.main(["--check"]) == 0
    assert cc.main(["--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "chat.json").read_text())
    assert written["content_sha256"] == SHIPPED["content_sha256"] and written["test"] == SHIPPED["test"]
    assert (tmp_path / "chat-test.jsonl.gz").read_bytes() == (ROOT / "headway/data/corpora/chat-test.jsonl.gz").read_bytes()


def test_the_test_split_does_not_depend_on_the_python_version_and_never_repeats_heldout(cc):
    test = cc.chat_prompts("test")
    digest = hashlib.sha256("\n".join(p.id("test") + "\t" + p.text for p in test).encode()).hexdigest()
    assert digest[:16] == "c5db67e80b7e77f7", digest[:16]  # what the package ships (test_data_chat_corpus)
    assert not {_norm(p.text) for p in test} & {_norm(p.text) for p in cc.chat_prompts("heldout")}
    data, entry = cc.frozen_test_bytes()
    assert entry["content_sha256"] == SHIPPED["test"]["content_sha256"] and entry["count"] == 300
    assert cc.frozen_bytes()[1]["test"] == entry  # the manifest names the test file


def test_heldout_does_not_depend_on_the_python_version(cc):
    digest = hashlib.sha256("\n".join(p.id("heldout") + "\t" + p.text for p in cc.chat_prompts("heldout"))
                            .encode()).hexdigest()
    assert digest[:16] == "86b9a4e4ba1af73c", digest[:16]


def test_splits_share_no_subject(cc):
    train_subjects = {x.lower() for xs in cc.TRAIN_SUBJECTS.values() for x in xs}
    train_text = "\n".join(p.text.lower() for p in cc.chat_prompts("train"))
    for xs in cc.HELDOUT_SUBJECTS.values():
        for x in xs:
            assert x.lower() not in train_subjects, x
            if " " in x:  # multi-word held-out subjects never occur in a train prompt
                assert x.lower() not in train_text, x


def test_prompt_lengths_are_bounded_and_templates_filled(cc):
    prompts = cc.chat_prompts("train") + cc.chat_prompts("heldout")
    for p in prompts:
        assert cc.MIN_CHARS <= len(p.text) <= cc.MAX_CHARS and p.text == p.text.strip(), p
        if p.family not in cc.VERBATIM_FAMILIES:
            assert not re.search(r"\{\w+\}", p.text), p
    lengths = [len(p.text) for p in cc.chat_prompts("train")]
    assert sum(n < 80 for n in lengths) > 300 and sum(n > 300 for n in lengths) > 200


def test_deterministic(cc):
    train = cc.chat_prompts("train")
    cc.chat_prompts.cache_clear()
    assert cc.chat_prompts("train") == train
    assert cc.frozen_bytes()[0] == cc.frozen_bytes()[0]  # gzip mtime 0: the bytes depend only on the prompts


def test_articles_and_plurals(cc):
    assert cc._articles("a optician and a urban planner, a ultimate a unique a one-off a LED a UX") == \
        "an optician and an urban planner, an ultimate a unique a one-off an LED a UX"
    assert [cc._plural(x) for x in ("red fox", "wolf", "otter")] == ["red foxes", "wolves", "otters"]


def test_the_prompts_do_not_depend_on_what_was_imported_first(cc):
    """torch replaces ``inspect.getfile`` when imported; the prompts must not notice."""
    import torch  # noqa: F401  (imported here, in this process, on purpose)

    code = ("import hashlib, runpy, sys\nm = runpy.run_path(sys.argv[1])\nassert 'torch' not in sys.modules\n"
            "print(hashlib.sha256(repr([(p.id(s), p.text) for s in ('train', 'extra') for p in m['chat_prompts'](s)])"
            ".encode()).hexdigest())")
    bare = subprocess.run([sys.executable, "-c", code, str(ROOT / "tools" / "chat_corpus.py")], capture_output=True,
                          text=True, check=True).stdout.strip()
    here = hashlib.sha256(repr([(p.id(s), p.text) for s in ("train", "extra")
                                for p in cc.chat_prompts(s)]).encode()).hexdigest()
    assert bare == here
