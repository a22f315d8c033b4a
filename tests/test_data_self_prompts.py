"""``headway prompts``: user turns the target writes itself (template cut, filters, sampling, resume)."""

import json
import re
from collections import Counter

import pytest
import torch

from headway.cli import main
from headway.data import self_prompts
from headway.data.errors import ChatTemplateError, DataError, ResumeMismatchError
from headway.data.generation import SamplingSettings, greedy_batch, sample_batch
from headway.data.self_prompts import PromptsConfig, Sieve, normalise, turn_stop_ids, user_turn, write_prompts
from headway.target import load_target
from headway.testing import tiny_target

CHATML = ("{% for m in messages %}<|bos|>{{ m.role }}\n{{ m.content }}<|eos|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")
SHOUTING = "{% for m in messages %}{{ m.role }}: {{ m.content | upper }}\n{% endfor %}"

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on a shared 2-core machine


def test_the_user_turn_starts_where_the_template_puts_the_users_text():
    _, tok = tiny_target()
    turn = user_turn(tok, CHATML, None)
    assert turn.prefix == "<|bos|>user\n" and turn.end_text == "<|eos|>\n"
    turn = user_turn(tok, CHATML, "Be brief.")
    assert turn.prefix == "<|bos|>system\nBe brief.<|eos|>\n<|bos|>user\n"
    assert turn_stop_ids(tok, turn) == [tok.eos_token_id]  # the template's end of turn ends a sampled turn
    plain = user_turn(tok, "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}", None)
    assert plain.prefix == "user: " and turn_stop_ids(tok, plain) == []  # "\n" is no special token
    with pytest.raises(ChatTemplateError, match="verbatim"):
        user_turn(tok, SHOUTING, None)


def test_the_sieve_drops_unusable_and_repeated_turns_and_says_why():
    sieve = Sieve(min_chars=5, max_chars=40, markers=("<|eos|>",), excluded={normalise("A benchmark prompt")})
    assert sieve.keep("  Plan a trip to Lisbon.  ", True) == "Plan a trip to Lisbon."
    assert sieve.keep("plan a   TRIP to lisbon.", True) is None  # same words, case and spacing aside
    assert sieve.keep("Write a poem about rain", False) is None  # cut by max_new_tokens
    assert sieve.keep("Hi", True) is None
    assert sieve.keep("x" * 41, True) is None
    assert sieve.keep("Two turns <|eos|> in one", True) is None
    assert sieve.keep("broken \ufffd bytes", True) is None
    assert sieve.keep("a benchmark  prompt", True) is None
    assert sieve.dropped == Counter({"duplicate": 1, "unfinished": 1, "too short": 1, "too long": 1,
                                     "special tokens": 1, "broken characters": 1, "excluded": 1})


def test_sampled_batches_follow_the_targets_distribution():
    """First tokens of 4,000 rows sampled at T=0.7, top-k 5 against the processed softmax."""
    model, _ = tiny_target()
    prompt = [5, 17, 42, 9]
    logits = model(torch.tensor([prompt])).logits[0, -1].float() / 0.7
    top = logits.topk(5)
    expect = torch.zeros_like(logits).index_put_((top.indices,), top.values.softmax(-1))
    settings = SamplingSettings(temperature=0.7, top_k=5, max_new_tokens=1)
    answers = sample_batch(model, [prompt] * 4000, settings, stop_ids=[1], pad_id=2, seed=3)
    seen = torch.bincount(torch.tensor([a.tokens[0] for a in answers]), minlength=logits.numel()).float() / 4000
    assert set(seen.nonzero().flatten().tolist()) <= set(top.indices.tolist())
    assert (seen - expect).abs().sum() / 2 < 0.04  # total variation; ~0.01 expected at this sample size


def test_sampled_batches_are_reproducible_and_near_zero_temperature_is_greedy():
    model, _ = tiny_target()
    prompts = [[5, 17, 42], [7, 8], [100, 101, 102, 103]]
    s = SamplingSettings(temperature=1.5, max_new_tokens=10)
    first = sample_batch(model, prompts, s, [1], 2, seed=11)
    assert first == sample_batch(model, prompts, s, [1], 2, seed=11)
    assert first != sample_batch(model, prompts, s, [1], 2, seed=12)
    cold = sample_batch(model, prompts, SamplingSettings(temperature=1e-4, max_new_tokens=10), [1], 2, seed=0)
    assert cold == greedy_batch(model, prompts, 10, [1], 2)


@pytest.fixture(scope="module")
def chat_dir(target_dirs, tmp_path_factory):
    """The tiny target with a chat template, and stop tokens: its random weights write about uniform
    tokens and rarely <|eos|>, so every token that is not printable ASCII text (byte pieces, control
    characters: ~40% of the vocabulary) ends a turn, and turns end within a few tokens."""
    model, tok = load_target(str(target_dirs["llama"]))
    stops = [tok.convert_ids_to_tokens(i) for i in range(4, len(tok))
             if not (tok.decode([i]).isascii() and tok.decode([i]).isprintable())]
    path = tmp_path_factory.mktemp("chat-target")
    model.save_pretrained(path)
    tok.chat_template = CHATML
    tok.save_pretrained(path)
    return path, stops


def cfg_for(chat_dir, out, **kw) -> PromptsConfig:
    path, stop = chat_dir
    base = dict(target=str(path), output=str(out), num=10, batch_size=4, max_new_tokens=12, min_chars=1,
                stop_tokens=stop)
    return PromptsConfig(**{**base, **kw})


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_prompts_are_written_in_whole_batches_as_distill_rows(chat_dir, tmp_path, capsys):
    path = write_prompts(cfg_for(chat_dir, tmp_path / "out", num=9))
    got = rows(path)
    assert len(got) >= 9 and len({r["id"] for r in got}) == len(got)
    progress = re.findall(r"prompts: (\d+)/(\d+) prompts", capsys.readouterr().err)
    assert progress[-1] == ("9", "9")  # the bar stops at num though the last whole batch passes it (10 rows)
    assert len({normalise(r["prompt"]) for r in got}) == len(got) and all(r["prompt"] for r in got)
    batches = {int(r["id"].split(":")[1]) for r in got}
    settings = json.loads((tmp_path / "out" / "settings.json").read_text())
    assert settings["complete"] and settings["rows"] == len(got) and settings["batches"] == max(batches) + 1
    from headway.data.sources import read_samples  # what distill reads
    assert [s.prompt for s in read_samples(str(path)).samples] == [r["prompt"] for r in got]


def test_extended_and_interrupted_runs_write_what_one_run_writes(chat_dir, tmp_path, monkeypatch):
    one = rows(write_prompts(cfg_for(chat_dir, tmp_path / "one", num=16)))
    write_prompts(cfg_for(chat_dir, tmp_path / "ext", num=5))
    assert rows(write_prompts(cfg_for(chat_dir, tmp_path / "ext", num=16))) == one
    real, calls = self_prompts.append_rows, []

    def dies_on_third(path, new):
        calls.append(1)
        if len(calls) == 3:
            path.open("a").write('{"id": "self:2:0", "prom')  # a torn line, as a kill mid-write leaves
            raise KeyboardInterrupt
        real(path, new)

    monkeypatch.setattr(self_prompts, "append_rows", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        write_prompts(cfg_for(chat_dir, tmp_path / "cut", num=16))
    monkeypatch.setattr(self_prompts, "append_rows", real)
    assert rows(write_prompts(cfg_for(chat_dir, tmp_path / "cut", num=16))) == one
    with pytest.raises(ResumeMismatchError, match="temperature=1.0.*temperature=0.5"):
        write_prompts(cfg_for(chat_dir, tmp_path / "cut", num=20, temperature=0.5))


def test_excluded_prompts_are_never_written(chat_dir, tmp_path):
    first = rows(write_prompts(cfg_for(chat_dir, tmp_path / "a", num=4)))
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"prompt": first[0]["prompt"].upper()}) + "\n")
    again = rows(write_prompts(cfg_for(chat_dir, tmp_path / "b", num=4, exclude=[str(bench)])))
    assert normalise(first[0]["prompt"]) not in {normalise(r["prompt"]) for r in again}
    assert json.loads((tmp_path / "b" / "settings.json").read_text())["dropped"]["excluded"] >= 1


def test_bad_settings_and_targets_get_one_line_errors(chat_dir, llama_dir, tmp_path, capsys):
    with pytest.raises(DataError, match="temperature must be > 0"):
        cfg_for(chat_dir, tmp_path / "x", temperature=0.0)
    assert main(["prompts", "--target", str(llama_dir), "--output", str(tmp_path / "y")]) != 0
    assert "needs a chat template" in capsys.readouterr().err
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "prompts.jsonl").write_text('{"prompt": "mine"}\n')
    with pytest.raises(DataError, match="not empty"):
        write_prompts(cfg_for(chat_dir, tmp_path / "foreign"))
    good = write_prompts(cfg_for(chat_dir, tmp_path / "edited", num=2))
    n = len(rows(good))
    with good.open("a") as f:
        f.write('{"prompt": "added by hand"}\n')
    with pytest.raises(DataError, match=rf"prompts.jsonl:{n + 1}: not a row this command wrote"):
        write_prompts(cfg_for(chat_dir, tmp_path / "edited", num=50))


def test_a_target_that_never_ends_a_turn_is_reported(chat_dir, tmp_path):
    path, _ = chat_dir
    cfg = PromptsConfig(target=str(path), output=str(tmp_path / "o"), num=4, batch_size=2, max_new_tokens=2,
                        min_chars=1000)
    with pytest.raises(DataError, match="no usable user turn in 8 batches"):
        write_prompts(cfg)


def test_cli_writes_prompts_from_a_config_file(chat_dir, tmp_path, capsys):
    path, stop = chat_dir
    (tmp_path / "p.yaml").write_text(f"target: {path}\noutput: {tmp_path / 'out'}\nnum: 4\nbatch_size: 4\n"
                                     f"max_new_tokens: 12\nmin_chars: 1\nstop_tokens: {json.dumps(stop)}\n")
    assert main(["prompts", "--config", str(tmp_path / "p.yaml")]) == 0
    assert "wrote" in capsys.readouterr().err and len(rows(tmp_path / "out" / "prompts.jsonl")) >= 4
    assert main(["prompts", "--help"]) == 0
    assert "--exclude" in capsys.readouterr().out
