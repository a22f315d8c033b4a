"""Medusa-2 heads decode end to end: the adapter their checkpoint names is found
(``heads.metadata.adapter_dir``), merged into the target, and the CLI says so in one line; greedy
output equals the adapted target's own ``generate``, token for token."""

import builtins
import json

import pytest
import torch

from headway.cli import main
from headway.config import ConfigError, load_config
from headway.decode import Speculator
from headway.decode.args import DecodeError
from headway.bench.run import BenchConfig, bench, heads_adapter
from headway.heads import HeadsError, MedusaHeads, load_heads
from headway.heads.metadata import ADAPTER_SUBFOLDER, adapter_dir, read_metadata
from headway.target import load_target
from headway.testing import save_tiny_target, tiny_target
from headway.train.config import TrainConfig
from headway.train.recipe import fit
from headway.train.tasks import adapter_path

from train_utils import distilled_rows, save_rows

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on a shared 2-core machine

PROMPTS = ["def parse(self, text):\n    result = []", "class Stack:\n    def __init__(self"]
NOTE = "note: merged the LoRA adapter the heads name"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny target and Medusa-2 heads trained on it (3 steps), whose adapter is then given
    random LoRA B weights so that merging it visibly changes the target's greedy output."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("medusa2")
    target_dir = save_tiny_target(root / "target")
    data = save_rows(root / "data", distilled_rows(16, 384, seed=1))
    cfg = load_config(TrainConfig, None, {
        "target": str(target_dir), "data": str(data), "output_dir": str(root / "run"), "kind": "medusa2",
        "batch_size": 4, "max_steps": 3, "log_every": 1, "save_every": 0, "eval_fraction": 0.0, "progress": False,
        "medusa.num_heads": 3, "lora.r": 4, "optim.lr": 3e-3})
    target, tok = load_target(str(target_dir), device="cpu")
    heads = fit(cfg, target, tok)
    weights = heads / ADAPTER_SUBFOLDER / "adapter_model.safetensors"
    g = torch.Generator().manual_seed(0)
    tensors = {k: (torch.randn(v.shape, generator=g) * 0.5 if "lora_B" in k else v)
               for k, v in load_file(str(weights)).items()}
    save_file(tensors, str(weights))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return root, target_dir, heads


def greedy(model, ids, n):
    x = torch.tensor([ids])
    return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                          pad_token_id=2)[0, len(ids):].tolist()


def test_metadata_reads_the_adapter_written_by_training(trained):
    _, _, heads = trained
    meta = read_metadata(heads)
    assert meta["adapter"]["subfolder"] == ADAPTER_SUBFOLDER and meta["adapter"]["kind"] == "lora"
    assert adapter_dir(heads) == heads / ADAPTER_SUBFOLDER and (adapter_dir(heads) / "adapter_config.json").is_file()
    assert adapter_path(heads) == adapter_dir(heads)  # training's name for it reads the same way


def test_adapter_dir_reads_every_form(tmp_path):
    model, _ = tiny_target("llama")
    heads = MedusaHeads.for_target(model, num_heads=2)
    cases = [({"subfolder": "adapter", "kind": "lora"}, tmp_path / "h0" / "adapter"),
             ("lora", tmp_path / "h1" / "lora"),  # legacy: a path relative to the checkpoint
             (str(tmp_path / "elsewhere"), tmp_path / "elsewhere"),  # legacy: an absolute path
             (None, None)]
    for i, (entry, want) in enumerate(cases):
        heads.metadata = {"adapter": entry} if entry is not None else {}
        path = heads.save_pretrained(tmp_path / f"h{i}")
        assert adapter_dir(path) == want and adapter_dir(str(path)) == want
    heads.metadata = {"adapter": {"kind": "lora"}}  # no folder named: say what is expected
    with pytest.raises(HeadsError, match="subfolder"):
        adapter_dir(heads.save_pretrained(tmp_path / "bad"))
    with pytest.raises(HeadsError, match="no config.json"):
        adapter_dir(tmp_path)


def test_from_pretrained_merges_the_heads_adapter_and_matches_its_greedy_output(trained):
    _, target_dir, heads = trained
    merged, tok = load_target(str(target_dir), adapter=str(adapter_dir(heads)))
    plain, _ = load_target(str(target_dir))
    spec = Speculator.from_pretrained(str(target_dir), heads)  # no adapter argument
    assert spec.adapter == str(heads / ADAPTER_SUBFOLDER) and spec.adapter_from_heads
    changed = 0
    for p in PROMPTS:
        ids = tok(p)["input_ids"]
        ref = greedy(merged, ids, 16)
        changed += ref != greedy(plain, ids, 16)
        out = spec.generate(ids, max_new_tokens=16)
        assert out.ids == ref, p
    assert changed > 0  # the adapter matters: decoding the base target would not have matched
    explicit = Speculator.from_pretrained(str(target_dir), heads, adapter=str(adapter_dir(heads)))
    assert explicit.adapter_from_heads is False  # given by the caller: nothing to announce
    module = load_heads(heads)  # a module does not know its folder: the adapter must be named
    with pytest.raises(DecodeError, match="adapter=PATH"):
        Speculator.from_pretrained(str(target_dir), module)
    ids = tok(PROMPTS[0])["input_ids"]
    named = Speculator.from_pretrained(str(target_dir), module, adapter=str(adapter_dir(heads)))
    assert named.generate(ids, max_new_tokens=16).ids == greedy(merged, ids, 16)


def test_generate_cli_says_the_adapter_is_merged(trained, capsys):
    _, target_dir, heads = trained
    merged, tok = load_target(str(target_dir), adapter=str(adapter_dir(heads)))
    ref = greedy(merged, tok(PROMPTS[0])["input_ids"], 10)
    rc = main(["generate", "--target", str(target_dir), "--heads", str(heads), "--prompt", PROMPTS[0],
               "--max-new-tokens", "10"])
    out = capsys.readouterr()
    assert rc == 0 and out.out.rstrip("\n") == tok.decode(ref)
    notes = [line for line in out.err.splitlines() if NOTE in line]
    assert len(notes) == 1 and str(heads / ADAPTER_SUBFOLDER) in notes[0] and "Medusa-2" in notes[0]


def test_chat_cli_says_the_adapter_is_merged(trained, capsys, monkeypatch):
    _, target_dir, heads = trained
    lines = iter(["def f(x):"])

    def fake_input(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(builtins, "input", fake_input)
    assert main(["chat", "--target", str(target_dir), "--heads", str(heads), "--max-new-tokens", "4"]) == 0
    assert sum(NOTE in line for line in capsys.readouterr().err.splitlines()) == 1


def test_tune_cli_says_the_adapter_is_merged(trained, capsys):
    root, target_dir, heads = trained
    rc = main(["tune", "--target", str(target_dir), "--heads", str(heads), "--prompts", str(root / "prompts.jsonl"),
               "--num-prompts", "1", "--max-new-tokens", "6", "--probe-depth", "2", "--probe-rank", "2",
               "--sizes", "2", "--finalists", "1", "--repeats", "1", "--no-write"])
    assert rc == 0
    assert sum(NOTE in line for line in capsys.readouterr().err.splitlines()) == 1


def test_bench_merges_the_adapter_for_every_method_and_says_so(trained, capsys):
    root, target_dir, heads = trained
    report = bench(BenchConfig(target=str(target_dir), heads=[str(heads)], prompts=str(root / "prompts.jsonl"),
                               num_prompts=2, max_new_tokens=8, baselines=["none"], repeats=1, warmup=0,
                               progress=False))
    assert sum(NOTE in line for line in capsys.readouterr().err.splitlines()) == 1
    assert report["settings"]["adapter"] == str(heads / ADAPTER_SUBFOLDER)
    medusa = [m for m in report["methods"] if m["kind"] == "medusa"]
    assert medusa and all(m["exact_match"] == 1.0 for m in medusa)  # against HF generate on the adapted target


def test_bench_refuses_heads_that_name_different_adapters(tmp_path):
    model, _ = tiny_target("llama")
    paths = []
    for name in ("a", "b"):
        heads = MedusaHeads.for_target(model, num_heads=2)
        heads.metadata = {"adapter": {"subfolder": f"adapter-{name}"}}
        paths.append(str(heads.save_pretrained(tmp_path / name)))
    plain = MedusaHeads.for_target(model, num_heads=2).save_pretrained(tmp_path / "plain")
    assert heads_adapter([str(plain)]) is None
    assert heads_adapter([paths[0], str(plain)]) == str(tmp_path / "a" / "adapter-a")
    with pytest.raises(ConfigError, match="different adapters"):
        heads_adapter(paths)
