"""SpecForge 0.2.0 EAGLE-3, offline, on the prepared data (OUT/plan.json), on the CPU, in its own venv:
writes the draft config and run YAML SpecForge wants, trains through ``shims/specforge_cpu.py``, then
``specforge export --to hf``. Wall time and peak memory: ``/usr/bin/time -v`` around this script.

    ~/.cache/headway/peers/specforge/bin/python benchmarks/peers/run_specforge.py [OUT] [--max-steps N]

Settings it needs on a CPU, and why:
- ``training.fsdp_sharding: NO_SHARD`` (one gloo process; sharding a single rank buys nothing),
  ``training.attention_backend: sdpa`` (flex attention needs a GPU); ``model.torch_dtype`` stays its bf16
  (its TargetHead is always bf16, and the stored states are written in bf16 for it).
- An explicit draft config (``LlamaForCausalLMEagle3`` of the target's geometry, ``draft_vocab_size``,
  aux ids in SpecForge's numbering = the output of layer k) instead of its presets for 8B models.
- ``model.lm_head_key`` / ``embedding_key`` name the target's tensors (``model.embed_tokens.weight`` for
  both when the target ties them); ``OUT/specforge/target`` carries the index.json its TargetHead wants.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def draft_config(target: dict, plan: dict, ids: list) -> dict:
    theta = (target.get("rope_parameters") or {}).get("rope_theta", target.get("rope_theta", 10000.0))
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": target["hidden_size"], "intermediate_size": target["intermediate_size"],
            "num_attention_heads": target["num_attention_heads"], "num_key_value_heads": target["num_key_value_heads"],
            "head_dim": target.get("head_dim") or target["hidden_size"] // target["num_attention_heads"],
            "num_hidden_layers": 1, "rms_norm_eps": target["rms_norm_eps"],
            "max_position_embeddings": target["max_position_embeddings"], "rope_theta": theta,
            "rope_scaling": None, "vocab_size": target["vocab_size"], "draft_vocab_size": plan["draft_vocab_size"],
            "tie_word_embeddings": False, "torch_dtype": "float32", "pad_token_id": target.get("pad_token_id"),
            "bos_token_id": target.get("bos_token_id"), "eos_token_id": target.get("eos_token_id"),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default="runs/peers")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--ttt-steps", type=int, default=7, help="ttt_length (its default 7; the plan's for a fair run)")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    plan = json.loads((out / "plan.json").read_text())
    me = plan["peers"]["specforge"]
    target = json.loads((Path(me["target"]) / "config.json").read_text())
    work = out / "specforge"
    (work / "draft_config.json").write_text(json.dumps(draft_config(target, plan, me["aux_ids"]), indent=2))
    head = "model.embed_tokens.weight" if target.get("tie_word_embeddings") else "lm_head.weight"
    run = {"run_id": "peers", "output_dir": str(work / "output"),
           "model": {"target_model_path": str(Path(me["target"]).resolve()),
                     "draft_model_config": str(work / "draft_config.json"),
                     "vocab_mapping_path": str(Path(me["vocab_mapping"]).resolve()), "lm_head_key": head,
                     "embedding_key": "model.embed_tokens.weight", "torch_dtype": "bfloat16",
                     "aux_hidden_state_layer_ids": me["aux_ids"]},
           "data": {"hidden_states_path": str(Path(me["data"]).resolve()), "max_length": 1024,
                    "cache_dir": str(work / "cache"), "dataloader_num_workers": 0},
           "training": {"num_epochs": plan["epochs"], "batch_size": args.batch_size,
                        "learning_rate": plan["lr"]["specforge"], "fsdp_sharding": "NO_SHARD",
                        "attention_backend": "sdpa", "ttt_length": args.ttt_steps, "log_interval": 2, "seed": 0,
                        **({"max_steps": args.max_steps} if args.max_steps else {})}}
    (work / "run.json").write_text(json.dumps(run, indent=2))
    py = sys.executable
    subprocess.run([py, str(HERE / "shims" / "specforge_cpu.py"), "train", "--config", str(work / "run.json")],
                   check=True)
    ckpts = sorted((work / "output").rglob("*"), key=lambda p: p.stat().st_mtime)
    print("outputs:", [str(p) for p in ckpts[-5:]])


if __name__ == "__main__":
    main()
