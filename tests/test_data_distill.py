"""Self-distillation: loss masks, left padding, multi-turn regeneration, resume, bad input."""

import json
from pathlib import Path

import pytest
import torch

from headway.cli import main
from headway.data import distill as distill_mod
from headway.data.distill import DistillConfig, distill, load_distilled
from headway.data.errors import BadRowError, ChatTemplateError, DataError, ResumeMismatchError
from headway.data.generation import SamplingSettings, generate_batch, greedy_batch
from headway.data.vocab import load_token_counts, token_frequencies
from headway.target import load_target
from headway.testing import tiny_target

ZEPHYR = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content | trim }}{{ eos_token }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
PROMPTS = ["def add(a, b):", "import os\nimport sys\n\nclass Config:", "for i in range(10):",
           "x = [1, 2, 3]\nprint(", "def main():\n    parser =", "while True:", "class A(object):",
           "return self._cache[", "with open(path) as f:", "try:\n    import json"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on a shared 2-core machine


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cfg_for(llama_dir, src, out, **kw) -> DistillConfig:
    base = dict(source=str(src), output=str(out), target=str(llama_dir), max_new_tokens=12, batch_size=3,
                shard_size=4)
    return DistillConfig(**{**base, **kw})


def interrupt_after_one_shard(monkeypatch, run) -> None:
    """``run()`` a distill that dies (KeyboardInterrupt) as it is about to write its second shard."""
    real_write, written = distill_mod.write_shard, []

    def write_then_die(folder, j, rows, stats, feats=None):
        if len(written) == 1:
            raise KeyboardInterrupt
        written.append(j)
        return real_write(folder, j, rows, stats, feats)

    monkeypatch.setattr(distill_mod, "write_shard", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        run()
    monkeypatch.setattr(distill_mod, "write_shard", real_write)


def spans(mask):
    """[(start, end)] of the runs of 1s."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i)), None
            start = None
    return out


def greedy(model, prefix, n, stop=1):
    """The target's own greedy continuation of ``prefix`` (unbatched), through its stop token."""
    out = model.generate(torch.tensor([prefix]), max_new_tokens=n, do_sample=False, eos_token_id=stop,
                         pad_token_id=2)[0, len(prefix):].tolist()
    return out[: out.index(stop) + 1] if stop in out else out


def test_left_padding_gives_the_same_greedy_tokens_as_unbatched():
    for arch in ("llama", "qwen2", "gpt_neox"):
        model, tok = tiny_target(arch)
        prompts = [tok(p)["input_ids"] for p in PROMPTS[:5]]
        settings = SamplingSettings(max_new_tokens=10)
        batched = generate_batch(model, prompts, settings, stop_ids=[1], pad_id=2)
        for p, a in zip(prompts, batched):
            assert a.tokens == greedy(model, p, 10), arch
            assert a.stopped == (a.tokens[-1] == 1)


def test_greedy_batch_drops_finished_rows_and_writes_generates_tokens():
    for arch in ("llama", "qwen2", "gpt_neox"):
        model, tok = tiny_target(arch)
        prompts = [tok(p)["input_ids"] for p in PROMPTS[:6]]
        free = [greedy(model, p, 14, stop=-1) for p in prompts]
        # stop tokens that end rows at different steps: the 3rd token of row 0, the 7th of row 1
        stops = [free[0][2], free[1][6]]
        sizes: list[int] = []
        hook = model.register_forward_pre_hook(lambda m, a, kw: sizes.append(kw["input_ids"].shape[0]),
                                               with_kwargs=True)
        got = greedy_batch(model, prompts, 14, stop_ids=stops, pad_id=2)
        hook.remove()
        want = generate_batch(model, prompts, SamplingSettings(max_new_tokens=14), stop_ids=stops, pad_id=2)
        assert got == want, arch
        for p, a in zip(prompts, got):  # and each row is the target's own unbatched greedy answer
            ref = greedy(model, p, 14, stop=-1)
            cut = next((i for i, t in enumerate(ref) if t in stops), None)
            assert a.tokens == (ref[: cut + 1] if cut is not None else ref), arch
            assert a.stopped == (cut is not None)
        ended = sum(a.stopped for a in got)
        assert ended >= 2 and sizes[0] == len(prompts) and sizes[-1] <= len(prompts) - ended + 1, (arch, sizes)
        assert sizes == sorted(sizes, reverse=True), sizes


def test_sampling_is_reproducible_for_a_seed():
    model, tok = tiny_target("llama")
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:4]]
    s = SamplingSettings(temperature=1.0, top_p=0.9, max_new_tokens=8)
    a = generate_batch(model, prompts, s, [1], 2, seed=3)
    assert a == generate_batch(model, prompts, s, [1], 2, seed=3)
    assert a != generate_batch(model, prompts, s, [1], 2, seed=4)


def test_loss_mask_is_exactly_the_target_written_tokens(llama_dir, tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS])
    ds = load_distilled(distill(cfg_for(llama_dir, src, tmp_path / "out")))
    model, tok = load_target(str(llama_dir))
    assert len(ds) == len(PROMPTS) and ds["index"] == list(range(len(PROMPTS)))
    reasons = set()
    for row, prompt in zip(ds, PROMPTS):
        ids, mask = row["input_ids"], row["loss_mask"]
        n_prompt = len(tok(prompt)["input_ids"])
        assert tok.decode(ids[:n_prompt]) == prompt and not any(mask[:n_prompt])
        assert all(mask[n_prompt:])  # all the rest was written by the target
        assert ids[n_prompt:] == greedy(model, ids[:n_prompt], 12)
        reasons.add(row["finish_reason"])
        assert (row["finish_reason"] == "stop") == (ids[-1] == tok.eos_token_id)
    manifest = json.loads((tmp_path / "out" / "headway_distill.json").read_text())
    assert manifest["complete"] and manifest["rows"] == len(PROMPTS)
    assert manifest["settings"]["temperature"] == 0.0 and manifest["target_info"]["architecture"] == "LlamaForCausalLM"
    assert json.loads(ds.info.description)["generation"]["max_new_tokens"] == 12
    assert torch.equal(load_token_counts(tmp_path / "out"), token_frequencies(ds, 384))
    assert not (tmp_path / "out" / "shards").exists()


def test_a_shard_batches_prompts_of_similar_length_and_keeps_row_order(llama_dir, tmp_path, monkeypatch):
    """Left padding costs prefill in proportion to the longest prompt of a batch: a shard's plans
    are batched shortest first, and the rows still come out in source order."""
    rows = [{"prompt": "x " * n} for n in (30, 2, 17, 5, 25, 3, 1, 12)]
    src = write_jsonl(tmp_path / "p.jsonl", rows)
    seen = []
    real = distill_mod.distill_batch

    def spy(generate, tokenizer, plans, seed):
        seen.append([len(p.piece_ids[0]) for p in plans])
        return real(generate, tokenizer, plans, seed)

    monkeypatch.setattr(distill_mod, "distill_batch", spy)
    ds = load_distilled(distill(cfg_for(llama_dir, src, tmp_path / "out", shard_size=8, batch_size=3)))
    assert [len(b) for b in seen] == [3, 3, 2]
    flat = [n for b in seen for n in b]
    assert flat == sorted(flat)  # shortest first; the longest prompts share the last batch
    assert ds["index"] == list(range(len(rows)))
    _, tok = load_target(str(llama_dir))
    for row, r in zip(ds, rows):
        n = len(tok(r["prompt"])["input_ids"])
        assert tok.decode(row["input_ids"][:n]) == r["prompt"] and not any(row["loss_mask"][:n])


def test_multi_turn_regenerates_every_assistant_turn(llama_dir, tmp_path):
    conv = [{"role": "user", "content": "Write a loop"}, {"role": "assistant", "content": "OLD ANSWER"},
            {"role": "user", "content": "Now a function"}]
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": conv}, {"messages": conv[:1]},
                                             {"messages": conv + [{"role": "assistant", "content": "OLD"}]}])
    (tmp_path / "t.jinja").write_text(ZEPHYR)
    ds = load_distilled(distill(cfg_for(llama_dir, src, tmp_path / "out", chat_template=str(tmp_path / "t.jinja"))))
    model, tok = load_target(str(llama_dir))
    for row, n_answers in zip(ds, (2, 1, 2)):
        ids, mask = row["input_ids"], row["loss_mask"]
        answers = spans(mask)
        assert len(answers) == n_answers and "OLD" not in tok.decode(ids)
        for a, b in answers:  # each answer is the target's greedy answer to exactly the tokens before it
            assert ids[a:b] == greedy(model, ids[:a], 12)
        template_text = [tok.decode(ids[s:e]) for s, e in spans([1 - m for m in mask])]
        assert template_text[0] == "<|user|>\nWrite a loop<|eos|>\n<|assistant|>\n"
        if n_answers == 2:  # the end-of-turn <|eos|> appears once: written by the target or by the template
            wrote_eos = ids[answers[0][1] - 1] == tok.eos_token_id
            assert template_text[1] == ("" if wrote_eos else "<|eos|>") + "\n<|user|>\nNow a function<|eos|>\n<|assistant|>\n"


def test_interrupted_run_resumes_to_the_same_dataset(llama_dir, tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS])
    full = load_distilled(distill(cfg_for(llama_dir, src, tmp_path / "full"))).to_list()
    real_write, written = distill_mod.write_shard, []

    def write_then_die(folder, j, rows, stats, feats=None):
        if len(written) == 1:
            (folder / "shard-00001.tmp999").mkdir()  # a half-written shard of the killed run
            raise KeyboardInterrupt
        written.append(j)
        return real_write(folder, j, rows, stats, feats)

    monkeypatch.setattr(distill_mod, "write_shard", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        distill(cfg_for(llama_dir, src, tmp_path / "part"))
    assert sorted(p.name for p in (tmp_path / "part" / "shards").iterdir()) == ["shard-00000", "shard-00001.tmp999"]
    assert not (tmp_path / "part" / "state.json").exists()
    with pytest.raises(ResumeMismatchError) as e:  # other settings: refuse to mix, naming the setting
        distill(cfg_for(llama_dir, src, tmp_path / "part", temperature=0.7))
    assert "temperature=0.0" in str(e.value) and "temperature=0.7" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setattr(distill_mod, "write_shard", real_write)
    resumed = load_distilled(distill(cfg_for(llama_dir, src, tmp_path / "part"))).to_list()
    assert resumed == full
    distill(cfg_for(llama_dir, src, tmp_path / "part"))  # a complete folder: nothing to do


def test_a_sampled_run_resumes_to_the_same_dataset(llama_dir, tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS])
    cfg = dict(temperature=0.9, top_p=0.95, seed=5)
    rng = torch.get_rng_state()
    full = load_distilled(distill(cfg_for(llama_dir, src, tmp_path / "full", **cfg))).to_list()
    assert torch.equal(torch.get_rng_state(), rng)  # a user's seeded global RNG is left alone
    greedy_rows = load_distilled(distill(cfg_for(llama_dir, src, tmp_path / "greedy"))).to_list()
    assert sum(a["input_ids"] != b["input_ids"] for a, b in zip(full, greedy_rows)) >= 3  # really sampled
    interrupt_after_one_shard(monkeypatch, lambda: distill(cfg_for(llama_dir, src, tmp_path / "part", **cfg)))
    torch.rand(1000)  # whatever else the resuming process drew before: each batch has its own generator
    assert load_distilled(distill(cfg_for(llama_dir, src, tmp_path / "part", **cfg))).to_list() == full
    other = load_distilled(distill(cfg_for(llama_dir, src, tmp_path / "seed6", **{**cfg, "seed": 6}))).to_list()
    assert other != full


def test_changed_prompts_refuse_to_resume(llama_dir, tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS[:3]])
    distill(cfg_for(llama_dir, src, tmp_path / "out"))
    write_jsonl(src, [{"prompt": p} for p in PROMPTS[3:6]])
    with pytest.raises(ResumeMismatchError, match="prompts="):
        distill(cfg_for(llama_dir, src, tmp_path / "out"))


def test_a_later_slice_merged_equals_one_run(llama_dir, tmp_path):
    """More data later: distil the prompts after the first N (skip), merge, and get the rows one
    run over all prompts gives; skip is a resume setting (a folder of skip=0 is refused)."""
    from headway.data.merge import merge

    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS])
    one = load_distilled(distill(cfg_for(llama_dir, src, tmp_path / "one"))).to_list()
    first = distill(cfg_for(llama_dir, src, tmp_path / "a", limit=6))
    with pytest.raises(ResumeMismatchError, match="skip=0.*skip=6"):
        distill(cfg_for(llama_dir, src, tmp_path / "a", limit=6, skip=6))
    with pytest.raises(ResumeMismatchError, match=r"limit=6, but this run has limit=10.*--skip 6 --limit 4.*"
                                                  r"headway merge"):  # a finished folder: how to add the rest
        distill(cfg_for(llama_dir, src, tmp_path / "a", limit=10))
    later = distill(cfg_for(llama_dir, src, tmp_path / "b", skip=6))
    assert json.loads((later / "headway_distill.json").read_text())["settings"]["skip"] == 6
    both = load_distilled(merge([first, later], tmp_path / "ab")).to_list()
    keys = ("id", "input_ids", "loss_mask")
    assert [{k: r[k] for k in keys} for r in both] == [{k: r[k] for k in keys} for r in one]


def test_overlong_prompts_are_dropped_or_truncated_and_counted(llama_dir, tmp_path):
    long = "value = compute(" + "x, " * 100 + ")"
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": PROMPTS[0]}, {"prompt": long}, {"prompt": PROMPTS[1]}])
    ds = load_distilled(distill(cfg_for(llama_dir, src, tmp_path / "drop", max_prompt_tokens=40)))
    assert ds["index"] == [0, 2]
    assert json.loads((tmp_path / "drop" / "headway_distill.json").read_text())["dropped"] == 1
    ds = load_distilled(distill(cfg_for(llama_dir, src, tmp_path / "cut", max_prompt_tokens=40, overlong="truncate")))
    assert ds["index"] == [0, 1, 2]
    row = ds[1]
    assert row["loss_mask"].index(1) == 40  # the prompt kept its last 40 tokens
    assert json.loads((tmp_path / "cut" / "headway_distill.json").read_text())["truncated"] == 1
    # a shard whose every prompt is dropped holds no row; the others still make the dataset
    src = write_jsonl(tmp_path / "q.jsonl", [{"prompt": long}] * 4 + [{"prompt": PROMPTS[0]}])
    ds = load_distilled(distill(cfg_for(llama_dir, src, tmp_path / "gap", max_prompt_tokens=40)))
    assert ds["index"] == [4]
    src = write_jsonl(tmp_path / "r.jsonl", [{"prompt": long}] * 2)
    with pytest.raises(DataError, match=r"every prompt \(2\) was dropped as longer than --max_prompt_tokens"):
        distill(cfg_for(llama_dir, src, tmp_path / "none", max_prompt_tokens=40))


def test_bad_rows_stop_the_run_or_are_skipped_and_counted(llama_dir, tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "def f():"}\n{"prompt": \n{"prompt": ""}\n{"prompt": "x = 1"}\n')
    with pytest.raises(BadRowError, match=r"p\.jsonl:2: invalid JSON"):
        distill(cfg_for(llama_dir, src, tmp_path / "out"))
    ds = load_distilled(distill(cfg_for(llama_dir, src, tmp_path / "out", skip_bad_rows=True)))
    assert ds["id"] == ["0", "3"]
    assert json.loads((tmp_path / "out" / "headway_distill.json").read_text())["bad_rows_skipped"] == 2


def test_messages_without_a_chat_template_suggest_the_option(llama_dir, tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "x"}, {"messages": [{"role": "user", "content": "Hi"}]}])
    with pytest.raises(ChatTemplateError, match="--chat-template") as e:
        distill(cfg_for(llama_dir, src, tmp_path / "out"))
    assert "row '1'" in str(e.value)


def test_cli_reports_errors_on_one_line(llama_dir, tmp_path, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "Hi"}]}])
    rc = main(["distill", str(src), "--output", str(tmp_path / "out"), "--target", str(llama_dir)])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' loading bar
    assert rc == 2 and err.startswith("headway distill: error:") and "--chat-template" in err and "\n" not in err


def test_cli_and_config_file(llama_dir, tmp_path, capsys):
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS[:3]])
    (tmp_path / "d.yaml").write_text(f"source: {src}\ntarget: {llama_dir}\nmax_new_tokens: 5\nshard_size: 2\n"
                                     "batch_size: 1\n")
    assert main(["distill", "--config", str(tmp_path / "d.yaml"), f"output={tmp_path / 'out'}"]) == 0
    assert len(load_distilled(tmp_path / "out")) == 3
    # stderr is captured, not a terminal: a plain line per prompt (3 < 20), with rates and an ETA
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("distill: ")]
    assert [x.split()[1] for x in lines] == ["1/3", "2/3", "3/3"]
    assert all("prompts/s" in x and "tok/s" in x and "ETA" in x for x in lines)


def test_a_foreign_output_folder_is_not_overwritten(llama_dir, tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "precious.txt").write_text("keep me")
    with pytest.raises(Exception, match="not empty"):
        distill(cfg_for(llama_dir, src, tmp_path / "out"))


def test_shipped_demo_config_loads():
    from headway.config import load_config

    cfg = load_config(DistillConfig, Path(__file__).parents[1] / "configs" / "demo" / "distill.yaml")
    assert cfg.source == "demo:train" and cfg.target == "demo"


HOLD_LOCK = """
import sys, time
from pathlib import Path
from headway.locking import output_lock
with output_lock(Path(sys.argv[1]), RuntimeError):
    print("locked", flush=True)
    time.sleep(300)
"""


def test_a_second_distill_into_the_same_folder_is_refused(llama_dir, tmp_path):
    """Another process writing the folder (its lock held) -> one clear line, not a raw OSError later."""
    import os
    import subprocess
    import sys

    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS[:2]])
    out = tmp_path / "out"
    repo = str(Path(__file__).resolve().parents[1])
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")})
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(DataError) as e:
            distill(cfg_for(llama_dir, src, out))
        assert str(e.value) == (f"{out} is being written by another headway process (pid {holder.pid}); wait for "
                                "it to finish, or choose another output folder")
    finally:
        holder.kill()
        holder.wait()
    assert len(load_distilled(distill(cfg_for(llama_dir, src, out)))) == 2  # the lock died with its process


def test_a_folder_of_another_distill_config_is_refused_before_the_target_loads(llama_dir, tmp_path, monkeypatch):
    import headway.target

    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS[:2]])
    out = distill(cfg_for(llama_dir, src, tmp_path / "out"))
    with monkeypatch.context() as m:
        m.setattr(headway.target, "load_target", lambda *a, **k: pytest.fail("the target loaded before the refusal"))
        with pytest.raises(ResumeMismatchError) as e:
            distill(cfg_for(llama_dir, src, out, max_new_tokens=5))
    assert str(e.value) == (f"{out} holds a finished dataset made with max_new_tokens=12, but this run has "
                            "max_new_tokens=5; rerun with the same settings, choose a new output folder, or pass "
                            "--overwrite")
    again = distill(cfg_for(llama_dir, src, out, max_new_tokens=5, overwrite=True))  # --overwrite replaces it
    assert json.loads((again / "headway_distill.json").read_text())["settings"]["max_new_tokens"] == 5
