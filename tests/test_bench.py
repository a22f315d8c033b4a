"""``headway bench``: the report's schema, the exact-match column (and that it can fail), the plot, the CLI,
and prompts tokenised exactly as ``headway distill`` conditions the target (chat template or raw)."""

import copy
import dataclasses
import json
import sys

import pytest
import torch

from headway.cli import main
from headway.config import ConfigError, load_config
from headway.bench import methods as bench_methods
from headway.data.distill import DistillConfig, distill, load_distilled
from headway.data.plans import make_plan
from headway.data.samples import Sample
from headway.bench.run import BenchConfig, bench, load_prompts, schedule
from headway.bench.methods import depth_counts
from headway.bench.report import METHOD_KEYS, SCHEMA, first_difference, render_table, write_plot
from headway.heads import Eagle1Drafter, Eagle3Drafter, MedusaHeads
from headway.target import load_target
from headway.testing import save_tiny_target, tiny_target

PROMPTS = ["def parse(self, text):\n    result = []", "class Stack:\n    def __init__(self"]
BASELINES = {"hf_generate", "hf_assisted", "hf_prompt_lookup"}
# A chat template whose assistant turn starts with text the generation prompt lacks (like Qwen3's
# empty think block): the text distill puts before an answer is not add_generation_prompt's.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}<|assistant|>\n<think></think>"
            "{{ m.content }}{{ eos_token }}\n{% else %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}\n{% endif %}"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a loop"},
        {"role": "assistant", "content": "OLD"}, {"role": "user", "content": "Now a function"}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    save_tiny_target(root / "target", "llama", seed=0)
    save_tiny_target(root / "assistant", "llama", seed=1)  # same tokenizer, different weights
    model, _ = tiny_target("llama", seed=0)
    torch.manual_seed(1)
    medusa = MedusaHeads.for_target(model, num_heads=3)
    with torch.no_grad():  # random (not zero) ResBlocks so the heads disagree with the target
        for p in medusa.blocks.parameters():
            p.normal_(0, 0.05)
    medusa.save_pretrained(root / "medusa")
    Eagle1Drafter.for_target(model).save_pretrained(root / "eagle1")
    Eagle3Drafter.for_target(model, draft_vocab_size=200).save_pretrained(root / "eagle3")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    # the same target with a chat template (the heads above fit it), prompts with a messages row and a
    # plain prompt ending in whitespace, and the template as a file for targets without one
    _, tok = tiny_target("llama", seed=0)
    tok = copy.deepcopy(tok)
    tok.chat_template = TEMPLATE
    save_tiny_target(root / "chat-target", "llama", seed=0)
    tok.save_pretrained(root / "chat-target")
    rows = [{"prompt": PROMPTS[0] + "\n    "}, {"messages": CONV}, {"prompt": PROMPTS[1]}]
    (root / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "template.jinja").write_text(TEMPLATE)
    return root


def config(root, **kw):
    base = dict(target=str(root / "target"), heads=[str(root / k) for k in ("medusa", "eagle1", "eagle3")],
                prompts=str(root / "prompts.jsonl"), assistant=str(root / "assistant"), max_new_tokens=12,
                temperature=[0.0, 1.0], repeats=2, warmup=1, progress=False)
    return BenchConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def report(folders):
    return bench(config(folders))


def test_report_follows_the_schema(report):
    assert report["schema"] == SCHEMA
    for key in ("target", "assistant", "settings", "prompts", "repetition_rate", "methods"):
        assert key in report
    json.dumps(report)  # machine-readable as is
    assert report["prompts"]["count"] == len(PROMPTS)
    assert 0.0 <= report["repetition_rate"] <= 1.0
    kinds = {(m["kind"], m["temperature"]) for m in report["methods"]}
    for t in (0.0, 1.0):
        assert {k for k, temp in kinds if temp == t} == BASELINES | {"medusa", "eagle1", "eagle3"}
    assert len(report["methods"]) == 12  # (3 baselines + 3 heads) x 2 temperatures
    for m in report["methods"]:
        assert set(METHOD_KEYS) <= set(m)
        assert isinstance(m["name"], str) and isinstance(m["tau"], float)
        assert m["tokens_per_s"] > 0 and m["speedup"] > 0
        assert isinstance(m["target_forwards"], int) and m["target_forwards"] > 0
        assert isinstance(m["accepted_per_depth"], list)
        assert all(0.0 <= a <= 1.0 for a in m["accepted_per_depth"])
        assert 0.0 <= m["overhead_share"] <= 1.0
        assert m["peak_mem_bytes"] >= m["param_bytes"] > 0 and m["peak_kv_bytes"] > 0
        assert m["runs"] == 2 * len(PROMPTS)
        assert (m["tree"] is None) == (m["kind"] in BASELINES)


def test_rows_name_the_tree_that_ran_at_each_temperature(report):
    trees = {(m["kind"], m["temperature"]): (m["name"], m["tree"]) for m in report["methods"]}
    for kind in ("eagle1", "eagle3"):  # default: EAGLE-2 dynamic tree greedy, sampled 4-chain at T > 0
        assert trees[(kind, 0.0)] == (f"{kind}[dynamic-4-5-16]", "dynamic-4-5-16")
        assert trees[(kind, 1.0)] == (f"{kind}[chain-4]", "chain-4")
    assert trees[("medusa", 0.0)] == trees[("medusa", 1.0)] == ("medusa[chain-3]", "chain-3")
    nodes = {(m["kind"], m["temperature"]): m["tree_nodes"] for m in report["methods"]}
    for kind in ("eagle1", "eagle3"):  # tokens per verify: a 16-node tree and a 4-chain (+ roots)
        assert 4 < nodes[(kind, 0.0)] <= 16 and nodes[(kind, 1.0)] == 5
    assert nodes[("medusa", 0.0)] == 4
    assert all(nodes[(k, t)] is None for k in BASELINES for t in (0.0, 1.0))


def test_exact_match_is_total_at_temperature_zero(report):
    for m in report["methods"]:
        if m["temperature"] == 0:
            assert m["exact_match"] == 1.0, m["name"]
            assert m["mismatches"] == []
        else:
            assert m["exact_match"] is None


def test_plain_decoding_has_tau_one_and_the_baseline_speedup_is_one(report):
    for m in report["methods"]:
        if m["kind"] == "hf_generate":
            assert m["tau"] == 1.0 and m["speedup"] == 1.0 and m["accepted_per_depth"] == []
            assert m["acceptance_length"] == 1.0
        if m["kind"] in ("eagle1", "eagle3") and m["temperature"] == 0:  # the prefill forward left out
            runs, fwd = m["runs"], m["target_forwards"]
            assert m["acceptance_length"] == pytest.approx((m["new_tokens"] - runs) / (fwd - runs))
            assert m["acceptance_length"] >= m["tau"] >= 1.0
        if m["kind"] == "medusa":
            assert len(m["accepted_per_depth"]) == 3  # one rate per tree depth, zeros included


def test_exact_match_detects_a_wrong_token(folders, monkeypatch):
    real = bench_methods.HeadwayMethod.generate

    def corrupted(self, ids, max_new_tokens, temperature, seed):
        out = real(self, ids, max_new_tokens, temperature, seed)
        if self.kind == "medusa":
            out.ids[-1] = (out.ids[-1] + 1) % 384
        return out

    monkeypatch.setattr(bench_methods.HeadwayMethod, "generate", corrupted)
    rep = bench(config(folders, heads=[str(folders / "medusa"), str(folders / "eagle1")], temperature=[0.0],
                       repeats=1))
    by_kind = {m["kind"]: m for m in rep["methods"]}
    assert by_kind["medusa"]["exact_match"] == 0.0
    assert by_kind["medusa"]["mismatches"][0]["position"] == 11  # the last of 12 tokens
    assert by_kind["eagle1"]["exact_match"] == 1.0


def test_plot_is_written(report, tmp_path):
    path = write_plot(report, tmp_path / "sub" / "bench.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


def test_cli_end_to_end(folders, tmp_path, capsys):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = main(["bench", "--target", str(folders / "target"), "--heads", str(folders / "medusa"),
               "--prompts", str(folders / "prompts.jsonl"), "--assistant", str(folders / "assistant"),
               "--max-new-tokens", "8", "--repeats", "1", "--tree", "chain-2", "mc_sim_7b_63",
               "--json", str(out), "--plot", str(png)])
    assert rc == 0
    # stderr is captured, not a terminal: plain progress lines with the rate and an ETA, to the last run
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("bench: ")]
    done, total = lines[-1].split()[1].split("/")
    assert len(lines) >= 2 and done == total and all("runs/s" in x and "ETA" in x for x in lines)
    rep = json.loads(out.read_text())
    assert rep["schema"] == SCHEMA
    assert [m["tree"] for m in rep["methods"] if m["kind"] == "medusa"] == ["chain-2", "mc_sim_7b_63[:3]"]
    assert png.stat().st_size > 1000


def test_without_matplotlib_the_plot_is_one_line_and_the_results_are_kept(folders, tmp_path, capsys, monkeypatch):
    """``pip install headway`` has no matplotlib: the table and the JSON are written, the plot is
    skipped with one line naming what to install, and the command succeeds."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = main(["bench", "--target", str(folders / "target"), "--heads", str(folders / "medusa"),
               "--prompts", str(folders / "prompts.jsonl"), "--assistant", "none", "--max-new-tokens", "4",
               "--repeats", "1", "--tree", "chain-2", "--json", str(out), "--plot", str(png)])
    assert rc == 0 and json.loads(out.read_text())["schema"] == SCHEMA and not png.exists()
    lines = [x for x in capsys.readouterr().out.splitlines() if "installed" in x]
    assert lines == ["plot skipped: matplotlib is not installed (pip install 'headway[plot]', or pip install "
                     "matplotlib)"]


def test_a_target_without_a_default_assistant_asks_for_one(folders):
    with pytest.raises(ConfigError, match="--assistant"):
        bench(config(folders, assistant=None))


def distilled_prompts(root, target, prompts, **kw) -> list[list[int]]:
    """What ``headway distill`` conditioned the target's first answer on, per row."""
    cfg = DistillConfig(source=str(root / prompts), output=str(root / "distilled"), target=str(root / target),
                        max_new_tokens=2, batch_size=4, overwrite=True, **kw)
    return [row["input_ids"][: row["loss_mask"].index(1)] for row in load_distilled(distill(cfg))]


def bench_prompts(root, target, prompts, **kw):
    _, tok = load_target(str(root / target))
    return load_prompts(config(root, target=str(root / target), prompts=str(root / prompts), **kw), tok)


@pytest.mark.parametrize("target,prompts,kw,fmt", [
    ("chat-target", "mixed.jsonl", {}, "chat (template of the target)"),
    ("chat-target", "mixed.jsonl", {"prompt_format": "raw"}, "mixed: chat (template of the target) for 1, raw for 2"),
    ("chat-target", "prompts.jsonl", {"prompt_format": "raw"}, "raw"),
    ("target", "prompts.jsonl", {}, "raw"),
    ("target", "mixed.jsonl", {"chat_template": "TEMPLATE"}, "chat (template from TEMPLATE)"),
])
def test_bench_prompts_are_what_distill_conditioned_on(folders, target, prompts, kw, fmt):
    kw = {k: str(folders / "template.jinja") if v == "TEMPLATE" else v for k, v in kw.items()}
    got = bench_prompts(folders, target, prompts, **kw)
    assert got.ids == distilled_prompts(folders, target, prompts, **kw)
    assert got.format == fmt.replace("TEMPLATE", str(folders / "template.jinja"))


def test_chat_targets_get_the_template_and_raw_gets_the_prompt_as_it_is(folders):
    _, tok = load_target(str(folders / "chat-target"))
    plain = Sample("0", prompt=PROMPTS[0] + "\n    ")
    chat = bench_prompts(folders, "chat-target", "mixed.jsonl")
    assert chat.ids[0] == make_plan(0, plain, tok, TEMPLATE, "auto", "t").piece_ids[0]
    assert tok.decode(chat.ids[0]) == f"<|bos|><|user|>\n{plain.prompt}<|eos|>\n<|assistant|>\n<think></think>"
    assert tok.decode(chat.ids[1]).endswith("Write a loop<|eos|>\n<|assistant|>\n<think></think>")
    raw = bench_prompts(folders, "chat-target", "mixed.jsonl", prompt_format="raw")
    assert raw.ids[0] == tok(plain.prompt)["input_ids"] and raw.ids[2] == tok(PROMPTS[1])["input_ids"]
    assert raw.ids[1] == chat.ids[1]  # messages always need the template
    assert raw.names == chat.names == ["0", "1", "2"]


def test_report_names_the_prompt_format_and_baselines_can_skip_the_assistant(folders, report, tmp_path):
    assert report["prompts"]["prompt_format"] == "raw" and "prompts (raw)" in render_table(report).title
    out = tmp_path / "bench.json"
    rc = main(["bench", "--target", str(folders / "chat-target"), "--heads", str(folders / "medusa"),
               "--prompts", str(folders / "mixed.jsonl"), "--baselines", "hf-prompt-lookup", "--max-new-tokens", "6",
               "--repeats", "1", "--warmup", "0", "--no-progress", "--json", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["prompts"]["prompt_format"] == "chat (template of the target)"
    assert "prompts (chat (template of the target))" in render_table(rep).title
    assert rep["assistant"] is None and rep["settings"]["baselines"] == ["hf-prompt-lookup"]
    assert {m["kind"] for m in rep["methods"]} == {"hf_generate", "hf_prompt_lookup", "medusa"}
    assert all(m["exact_match"] == 1.0 for m in rep["methods"])


def test_prompt_options_match_distill_and_are_checked(folders):
    bench_fields = {f.name: f for f in dataclasses.fields(BenchConfig)}
    for f in dataclasses.fields(DistillConfig):
        if f.name in ("prompt_format", "chat_template"):
            assert (bench_fields[f.name].default, bench_fields[f.name].metadata) == (f.default, f.metadata)
    assert BenchConfig(target="t").baselines == ["hf-assisted", "hf-prompt-lookup"]
    assert BenchConfig(target="t", baselines=["none"]).baselines == []
    with pytest.raises(ConfigError, match="prompt_format"):  # choices: enforced by the config parser
        load_config(BenchConfig, None, {"target": "t", "prompt_format": "jinja"})
    with pytest.raises(ConfigError, match="baselines"):
        BenchConfig(target="t", baselines=["hf-assisted", "vllm"])
    with pytest.raises(ConfigError, match="leaves out hf-assisted"):
        BenchConfig(target="t", assistant="some/model", baselines=["hf-prompt-lookup"])
    with pytest.raises(ConfigError, match="--baselines hf-prompt-lookup"):
        bench(config(folders, assistant=None))


def test_assistant_none_skips_the_assisted_baseline(folders, tmp_path, monkeypatch):
    from headway.config import parse_cli
    from headway.bench import run as bench_mod

    cfg = parse_cli(BenchConfig, ["--target", "demo", "--assistant", "none"])  # the demo target included
    assert cfg.target == "demo" and cfg.assistant is None and cfg.baselines == ["hf-prompt-lookup"]
    monkeypatch.setattr(bench_mod, "default_assistant", lambda *a: pytest.fail("built the demo assistant"))
    assert bench_mod.load_assistant(cfg, "/any/demo-target", None) == (None, None)
    assert BenchConfig(target="t", assistant="None").baselines == ["hf-prompt-lookup"]
    out = tmp_path / "bench.json"
    assert main(["bench", "--target", str(folders / "target"), "--heads", str(folders / "medusa"),
                 "--prompts", str(folders / "prompts.jsonl"), "--assistant", "none", "--max-new-tokens", "4",
                 "--repeats", "1", "--warmup", "0", "--no-progress", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["assistant"] is None and {m["kind"] for m in rep["methods"]} == {"hf_generate", "hf_prompt_lookup",
                                                                                "medusa"}


@pytest.mark.parametrize("args,message", [
    (["--heads", "/nope"], "heads checkpoint not found: no such folder '/nope'"),
    (["--heads", "NOT_HEADS"], "has no config.json; is it a headway heads checkpoint?"),
    (["--prompts", "/nope/prompts.jsonl"], "prompt source not found: /nope/prompts.jsonl"),
    (["--prompts", "demo:tset"], "unknown built-in prompt source 'demo:tset'"),
    (["--chat-template", "/nope/t.jinja"], "chat template file not found: /nope/t.jinja"),
    (["--assistant", "./nope-assistant"], "assistant not found"),
    (["--tree", "chain-x"], "cannot parse tree 'chain-x'"),
])
def test_arguments_are_checked_before_the_target_is_built(args, message, tmp_path, monkeypatch, capsys):
    """`headway bench --heads /nope` once built the demo target (23 minutes) before saying so."""
    import headway.target

    monkeypatch.setattr(headway.target, "resolve_target_path", lambda *a: pytest.fail("built the target"))
    monkeypatch.setattr(headway.target, "load_target", lambda *a, **k: pytest.fail("loaded the target"))
    (tmp_path / "junk").mkdir()
    args = [str(tmp_path / "junk") if a == "NOT_HEADS" else a for a in args]
    assert main(["bench", "--target", "demo", "--no-progress", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("headway bench: error: ") and message in err and "\n" not in err


def test_schedule_rotates_the_order():
    orders = [o for *_, o in schedule(3, repeats=2, n_prompts=3, temps=[0.0])]
    assert all(sorted(o) == [0, 1, 2] for o in orders)
    firsts = [o[0] for o in orders]
    assert firsts.count(0) == firsts.count(1) == firsts.count(2) == 2


def test_helpers():
    assert depth_counts([0, 2, 3, 1]) == [3, 2, 1]
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_calibration_on_and_off_side_by_side(folders, tmp_path):
    """``--calibration on off``: a second row only where calibration can change the drafts (a dynamic
    tree of heads that carry one); both exact, since calibration only picks which nodes are drafted."""
    heads = load_target(str(folders / "target"))[0]
    drafter = Eagle1Drafter.for_target(heads)
    drafter.metadata["calibration"] = {"temperature_by_depth": [0.3, 3.0, 0.3]}
    drafter.save_pretrained(tmp_path / "calibrated")
    rep = bench(config(folders, heads=[str(tmp_path / "calibrated")],
                       tree=["dynamic-3-3-8", "chain-2"], calibration=["on", "off"], temperature=[0.0],
                       baselines=[], assistant=None, repeats=1, warmup=0))
    names = sorted(m["name"] for m in rep["methods"] if m["kind"] == "eagle1")
    assert names == ["eagle1[chain-2]", "eagle1[dynamic-3-3-8]", "eagle1[dynamic-3-3-8][uncalibrated]"]
    assert all(m["exact_match"] == 1.0 for m in rep["methods"])
    with pytest.raises(ConfigError, match="calibration"):
        load_config(BenchConfig, overrides=["target=x", "calibration=sometimes"])


def test_verify_logits_side_by_side(folders):
    """``--verify-logits auto all``: the on-demand lm_head rows against every node's, both exact; the
    same trees and tokens, so tau agrees, and the CLI spelling parses."""
    rep = bench(config(folders, heads=[str(folders / "eagle1")], tree=["dynamic-3-3-10"], verify_logits=["auto", "all"],
                       temperature=[0.0], baselines=[], assistant=None, repeats=1, warmup=0))
    rows = {m["name"]: m for m in rep["methods"] if m["kind"] == "eagle1"}
    assert sorted(rows) == ["eagle1[dynamic-3-3-10]", "eagle1[dynamic-3-3-10][all-logits]"]
    assert all(m["exact_match"] == 1.0 for m in rows.values())
    assert len({(m["tau"], m["new_tokens"], m["target_forwards"]) for m in rows.values()}) == 1, [(m["tau"], m["new_tokens"], m["target_forwards"], m["draft_steps"]) for m in rows.values()]
    cfg = load_config(BenchConfig, overrides=["target=x", "verify_logits=[auto, all]"])
    assert cfg.verify_logits == ["auto", "all"] and "verify_logits" not in cfg.runtime_kwargs()
    with pytest.raises(ConfigError, match="verify_logits"):
        load_config(BenchConfig, overrides=["target=x", "verify_logits=some"])


def test_batch_size_benches_batched_greedy_throughput(folders, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--target", str(folders / "target"), "--heads", *(str(folders / k) for k in
                                                                        ("medusa", "eagle1", "eagle3")),
               "--prompts", str(folders / "prompts.jsonl"), "--max-new-tokens", "10", "--repeats", "1",
               "--tree", "chain-3", "--batch-size", "2", "1", "--no-progress", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "--batch-size" in printed and "hf-generate" in printed
    rep = json.loads(out.read_text())
    assert rep["methods"] == [] and rep["assistant"] is None and rep["settings"]["batch_size"] == [1, 2]
    rows = rep["batched"]
    assert [(e["batch_size"], e["kind"]) for e in rows] == [
        (b, k) for b in (1, 2) for k in ("hf_generate", "medusa", "eagle1", "eagle3")]
    for e in rows:
        assert e["exact_match"] == 1.0 and e["rows"] == len(PROMPTS) and e["tokens_per_s"] > 0
        assert e["speedup"] == 1.0 if e["kind"] == "hf_generate" else e["speedup"] > 0
        assert e["tau"] == 1.0 if e["kind"] == "hf_generate" else e["tau"] >= 1.0


@pytest.mark.parametrize("kw,message", [
    (dict(batch_size=[3]), "batch_size"),
    (dict(batch_size=[2], temperature=[0.0, -1.0]), "temperature"),
])
def test_batch_size_is_checked(kw, message):
    with pytest.raises(ConfigError, match=message):
        load_config(BenchConfig, None, {"target": "t", **kw})
    assert BenchConfig(target="t").batch_size == []
    assert load_config(BenchConfig, None, {"target": "t", "batch_size": [8, 1, 8]}).batch_size == [1, 8]


def test_weight_major_baseline_and_the_kernel_plan_are_reported(folders):
    """``--baselines hf-weight-major``: HF generate with the decoder's linear kernel (forced here), exact
    like the headway rows; the report names the plan each method decoded with."""
    rep = bench(config(folders, heads=[str(folders / "medusa")], temperature=[0.0], assistant=None,
                       baselines=["hf-weight-major", "hf-prompt-lookup-weight-major"], repeats=1, warmup=0,
                       linear_kernel="weight-major"))
    kinds = [m["kind"] for m in rep["methods"]]
    assert kinds == ["hf_generate", "hf_weight_major", "hf_prompt_lookup", "medusa"]
    assert all(m["exact_match"] == 1.0 for m in rep["methods"])
    assert rep["methods"][1]["tau"] == 1.0 and rep["methods"][2]["tau"] > 1.0  # plain decoding; drafts
    everywhere = "weight-major at 1, 2, 3-4, 5-8, 9-12, 13-16, 17-24, 25-32, 33-48, 49-64 rows"
    assert rep["settings"]["linear_kernels"] == {"hf-weight-major": everywhere, "medusa[chain-3]": everywhere,
                                                 "hf-prompt-lookup-weight-major": everywhere}
    assert "linear kernel: weight-major at 1" in render_table(rep).caption


def test_batch_size_benches_sampling_and_the_same_kernel_baseline(folders, tmp_path):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--target", str(folders / "target"), "--heads", str(folders / "eagle3"),
               "--prompts", str(folders / "prompts.jsonl"), "--max-new-tokens", "8", "--repeats", "1",
               "--tree", "chain-3", "--batch-size", "2", "--temperature", "0", "1", "--baselines", "hf-weight-major",
               "--no-progress", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["batched"]
    assert [(e["temperature"], e["kind"]) for e in rows] == [
        (t, k) for t in (0.0, 1.0) for k in ("hf_generate", "hf_weight_major", "eagle3")]
    for e in rows:
        assert (e["exact_match"] is None) == (e["temperature"] > 0)
        assert e["speedup_same_kernel"] > 0 and e["tokens_per_s_per_row"] == pytest.approx(e["tokens_per_s"] / 2)
    assert rows[2]["exact_match"] == 1.0 and rows[1]["speedup_same_kernel"] == 1.0
    # no tuned table: a batch of 2 decodes plainly (never slower than plain decoding); the baselines draft nothing
    assert [e["tree_at_batch"] for e in rows] == [None, None, "plain"] * 2


def test_batched_rows_name_the_tree_a_tuned_table_picks(folders):
    from headway.bench.batched import tree_at_batch
    from headway.bench.methods import HeadwayMethod
    from headway.decode import Speculator

    spec = Speculator.from_pretrained(str(folders / "target"), str(folders / "eagle3"), tree="chain-3")
    spec.policy.by_batch = {1: True, 2: spec.fit_tree("chain-1"), 4: False}
    m = HeadwayMethod("eagle3", spec, str(folders / "eagle3"))
    # 3 is nearer 4 than 2 by ratio
    assert [tree_at_batch(m, b, 0.0) for b in (1, 2, 3, 4, 8)] == ["chain-3", "chain-1", "plain", "plain", "plain"]


def test_reports_name_a_tuned_tree_by_the_name_tune_gave_it(folders):
    """A stored measured tree is a list of paths; the reports call it what tune called it."""
    from headway.bench.methods import HeadwayMethod
    from headway.bench.run import stored_names
    from headway.decode import Speculator

    decode = {"tree": "static:[[0],[1],[0,0]]", "chosen": "measured-4", "sampling_tree": "chain-2",
              "sampling_chosen": "chain-2"}
    names = stored_names(decode)
    assert names == {"static:[[0],[1],[0,0]]": "measured-4", "chain-2": "chain-2"}
    spec = Speculator.from_pretrained(str(folders / "target"), str(folders / "eagle3"), tree=decode["tree"],
                                      sampling_tree="chain-2")
    m = HeadwayMethod("", spec, str(folders / "eagle3"), names)
    assert m.tree == "measured-4" and m.label_at(1.0)[1] == "chain-2"
