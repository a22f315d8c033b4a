"""NVIDIA ModelOpt 0.47.0 EAGLE-3, offline, on the prepared data (OUT/plan.json), on the CPU, in its own venv.

ModelOpt's own driver (examples/speculative_decoding/main.py) is not in the wheel; this is the same
sequence: ``mtsp.convert(model, [("eagle", cfg)])`` on the target, its ``OfflineSupervisedDataset`` /
``EagleOfflineDataCollator``, HF ``Trainer(use_cpu=True)``, then ``export_speculative_decoding``
(a ``LlamaForCausalLMEagle3`` folder that ``headway import`` reads). No patch is needed.

    ~/.cache/headway/peers/modelopt/bin/python benchmarks/peers/run_modelopt.py [OUT] [--max-steps N]

Settings that differ from ModelOpt's defaults, and why:
- ``eagle_use_torch_compile: False``: no compile on a CPU run of a few minutes.
- ``eagle_export_rope_scaling: {}``: the export would otherwise write YaRN (factor 32) into the config,
  which the drafter was not trained with; the import must measure the trained drafter.
- ``eagle_ttt_steps``, epochs, batch size, draft vocabulary, aux layers: the plan's (same for every tool).
"""
import argparse
import json
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default="runs/peers")
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-steps", type=int, default=-1)
    args = ap.parse_args()
    out = Path(args.out)
    plan = json.loads((out / "plan.json").read_text())
    me = plan["peers"]["modelopt"]

    import modelopt.torch.speculative as mtsp
    from modelopt.torch.export import export_speculative_decoding
    from modelopt.torch.speculative.config import eagle3_default_config
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    model = AutoModelForCausalLM.from_pretrained(plan["target"], dtype=torch.float32)
    c = model.config
    theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", 10000.0))
    arch = {**eagle3_default_config, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": theta,
            "rope_scaling": {"rope_type": "default", "rope_theta": theta}, "torch_dtype": "float32",
            "draft_vocab_size": plan["draft_vocab_size"], "eagle_aux_hidden_state_layer_ids": me["aux_ids"]}
    mtsp.convert(model, [("eagle", {"eagle_offline": True, "eagle_architecture_config": arch,
                                    "eagle_ttt_steps": args.ttt_steps, "eagle_use_torch_compile": False,
                                    "eagle_export_rope_scaling": {}, "eagle_decoder_type": "llama"})])
    model.eagle_module.d2t.copy_(torch.load(me["d2t"], weights_only=True))

    files = sorted(str(p) for p in Path(me["data"]).glob("*.pt"))
    lengths = [torch.load(f, weights_only=True)["input_ids"].numel() for f in files]
    targs = TrainingArguments(output_dir=str(out / "modelopt" / "trainer"), use_cpu=True,
                              num_train_epochs=plan["epochs"], max_steps=args.max_steps,
                              per_device_train_batch_size=args.batch_size, learning_rate=plan["lr"]["modelopt"],
                              lr_scheduler_type="cosine", warmup_steps=2, logging_steps=2, save_strategy="no",
                              report_to=[], remove_unused_columns=False, dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=model, args=targs, train_dataset=OfflineSupervisedDataset(files, answer_only_loss=True),
                      data_collator=EagleOfflineDataCollator(train_len=max(lengths)))
    t0 = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - t0
    export_speculative_decoding(model, export_dir=str(out / "modelopt" / "export"))
    summary = {"train_seconds": round(seconds, 1), "steps": result.global_step, "tokens": plan["tokens"],
               "padded_to": max(lengths), "tokens_per_s": round(plan["tokens"] * plan["epochs"] / seconds, 1),
               "train_loss": result.training_loss}
    (out / "modelopt" / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
