"""SpecForge 0.2.0 EAGLE-3, offline, on the prepared data (OUT/plan.json), on the CPU, in its own venv:
writes the draft config and the run config SpecForge wants, trains through ``shims/specforge_cpu.py``
(the mode's options as its own dotted overrides), then ``specforge export --to hf`` of the last
checkpoint to RUN/export (what done.json names).

    ~/.cache/headway/peers/specforge/bin/python benchmarks/peers/run_specforge.py [OUT] \\
        [--defaults own|shared] [--run-dir DIR] [--set training.learning_rate=2e-4 --set training.max_steps=3 ...]

What every mode sets besides the data (rows, loss masks, the draft vocabulary's ids) and the aux layers,
and why:
- ``training.fsdp_sharding: NO_SHARD`` (one gloo process; sharding a single rank buys nothing),
  ``training.attention_backend: sdpa`` (flex attention needs a GPU), ``data.dataloader_num_workers: 0``
  (loader workers would take the cores the run is timed on).
- An explicit draft config: a ``LlamaForCausalLMEagle3`` layer of the target's geometry (as its example
  configs copy their target's), ``draft_vocab_size``, aux ids in SpecForge's numbering (the output of
  layer k), instead of its presets for 8B models.
- ``model.lm_head_key`` / ``embedding_key`` name the target's tensors (``model.embed_tokens.weight`` for
  both when the target ties them); ``OUT/specforge/target`` carries the index.json its TargetHead wants.
- ``training.log_interval: 10`` (its default 50 would print nothing in a short run; logging only).
Precision (``model.torch_dtype``, bf16 by default) is the mode's: neither mode changes it.
"""
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import runner  # noqa: E402


def draft_config(target: dict, draft_vocab: int, ids: list) -> dict:
    theta = (target.get("rope_parameters") or {}).get("rope_theta", target.get("rope_theta", 10000.0))
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": target["hidden_size"], "intermediate_size": target["intermediate_size"],
            "num_attention_heads": target["num_attention_heads"], "num_key_value_heads": target["num_key_value_heads"],
            "head_dim": target.get("head_dim") or target["hidden_size"] // target["num_attention_heads"],
            "num_hidden_layers": 1, "rms_norm_eps": target["rms_norm_eps"],
            "max_position_embeddings": target["max_position_embeddings"], "rope_theta": theta,
            "rope_scaling": None, "vocab_size": target["vocab_size"], "draft_vocab_size": draft_vocab,
            "tie_word_embeddings": False, "torch_dtype": "float32", "pad_token_id": target.get("pad_token_id"),
            "bos_token_id": target.get("bos_token_id"), "eos_token_id": target.get("eos_token_id"),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}}


def run_config(run: runner.Run, target: dict) -> dict:
    me, work = run.me, run.run_dir
    head = "model.embed_tokens.weight" if target.get("tie_word_embeddings") else "lm_head.weight"
    return {"run_id": "peers", "output_dir": str(work / "output"),
            "model": {"target_model_path": str(Path(me["target"]).resolve()),
                      "draft_model_config": str(work / "draft_config.json"),
                      "vocab_mapping_path": str(Path(run.vocab("mapping")).resolve()), "lm_head_key": head,
                      "embedding_key": "model.embed_tokens.weight", "aux_hidden_state_layer_ids": me["aux_ids"]},
            "data": {"hidden_states_path": str(Path(me["data"]).resolve()), "cache_dir": str(work / "cache"),
                     "dataloader_num_workers": 0},
            "training": {"fsdp_sharding": "NO_SHARD", "attention_backend": "sdpa", "log_interval": 10}}


def overrides(options: dict) -> list[str]:
    """{dotted key: value} -> SpecForge's ``key=value`` overrides (values as JSON, which its parser reads)."""
    return [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in options.items()]


def last_checkpoint(output: Path) -> Path:
    steps = [p for p in output.rglob("*") if p.is_dir() and p.name.startswith("peers-step")]
    if not steps:
        raise SystemExit(f"run_specforge.py: error: no peers-step* checkpoint under {output}")
    return max(steps, key=lambda p: int("".join(c for c in p.name.rsplit("step", 1)[1] if c.isdigit()) or 0))


def main() -> None:
    args = runner.parser("specforge", __doc__).parse_args()
    run = runner.start("specforge", args)
    if run is None:
        return
    target = json.loads((Path(run.me["target"]) / "config.json").read_text())
    work = run.run_dir
    (work / "draft_config.json").write_text(json.dumps(
        draft_config(target, run.settings["draft_vocab_size"], run.me["aux_ids"]), indent=2))
    (work / "run.json").write_text(json.dumps(run_config(run, target), indent=2))
    shim = str(HERE / "shims" / "specforge_cpu.py")
    subprocess.run([sys.executable, shim, "train", "--config", str(work / "run.json"), *overrides(run.options)],
                   check=True)
    ckpt = last_checkpoint(work / "output")
    subprocess.run([sys.executable, shim, "export", "--to", "hf", "--checkpoint", str(ckpt),
                    "--draft-config", str(work / "draft_config.json"), "--vocab-mapping", run.vocab("mapping"),
                    "--embedding-source", str(Path(run.me["target"]).resolve()), "--output-dir", str(work / "export")],
                   check=True)
    runner.finish(run, work / "export", trained_checkpoint=str(ckpt))


if __name__ == "__main__":
    main()
