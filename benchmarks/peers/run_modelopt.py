"""NVIDIA ModelOpt 0.47.0 EAGLE-3, offline, on the prepared data (OUT/plan.json), on the CPU, in its own venv.

ModelOpt's driver (examples/speculative_decoding/main.py) is not in the wheel; its recipe is
(``modelopt_recipes/general/speculative_decoding/eagle3.yaml``). This runs main.py's sequence on that
recipe: ``load_recipe`` with the mode's options as dotlist overrides, ``mtsp.convert(model, [("eagle",
recipe.eagle)])``, its ``OfflineSupervisedDataset`` / ``EagleOfflineDataCollator``, HF ``Trainer`` with
the recipe's training section, then ``export_speculative_decoding`` to RUN/export (a
``LlamaForCausalLMEagle3`` folder that ``headway import`` reads).

    ~/.cache/headway/peers/modelopt/bin/python benchmarks/peers/run_modelopt.py [OUT] \\
        [--defaults own|shared] [--run-dir DIR] [--set training.learning_rate=2e-4 --set training.max_steps=3 ...]

What every mode sets besides the data (rows, loss masks: ``answer_only_loss`` on, the draft vocabulary's
ids) and the aux layers, and why:
- ``use_cpu``, ``tf32: false`` (a GPU matmul mode; HF refuses it without one), ``eagle_use_torch_compile:
  false`` (no compile on a CPU run), ``dataloader_num_workers: 0``, ``report_to: []``.
- ``eagle_export_rope_scaling: {}``: the export would otherwise write YaRN (factor 32) into the config,
  which the drafter was not trained with; the import must measure the trained drafter.
- the collator pads every batch to the longest row instead of ``training_seq_len`` (2,048): the loss is
  averaged over loss-mask positions and attention is causal, so padding past the last row changes no
  number, only the time it takes.
- the draft layer: ``own`` keeps ModelOpt's preset (``eagle3_default_config``: a Llama-3-8B-sized layer,
  intermediate 14,336, 32 heads of 128, 8 KV heads); ``shared`` gives it the target's geometry.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import runner  # noqa: E402

RECIPE = "general/speculative_decoding/eagle3"


def target_geometry(c) -> dict:
    """The target's layer shape as eagle_architecture_config keys (the shared mode's draft layer)."""
    theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", 10000.0))
    return {"intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads,
            "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": theta,
            "rope_scaling": {"rope_type": "default", "rope_theta": theta}, "torch_dtype": "float32"}


def load(run: runner.Run, target_config) -> object:
    """ModelOpt's own recipe with the run's overrides (its loader validates every key)."""
    from modelopt.recipe import load_recipe

    arch = {"draft_vocab_size": run.settings["draft_vocab_size"],
            "eagle_aux_hidden_state_layer_ids": run.me["aux_ids"]}
    if run.settings.get("draft_layer") == "target":
        arch.update(target_geometry(target_config))
    fixed = {"model.model_name_or_path": run.plan["target"], "data.offline_data_path": run.me["data"],
             "data.draft_vocab_cache": run.vocab("d2t"), "training.output_dir": str(run.run_dir / "trainer"),
             "training.answer_only_loss": True, "training.tf32": False, "training.dataloader_num_workers": 0,
             "eagle.eagle_use_torch_compile": False, "eagle.eagle_architecture_config": arch}
    dotlist = [f"{k}={json.dumps(v)}" for k, v in {**fixed, **run.options}.items()]
    recipe = load_recipe(RECIPE, overrides=dotlist)
    data = recipe.model_dump()  # a dotlist merges into the recipe's YaRN dict; an empty one must replace it
    data["eagle"]["eagle_export_rope_scaling"] = {}
    return type(recipe).model_validate(data)


def training_arguments(recipe, run: runner.Run):
    """The recipe's training section as HF TrainingArguments (ModelOpt's own fields taken out)."""
    from modelopt.torch.speculative.plugins.hf_training_args import TrainingArguments as SpecArgs
    from transformers import TrainingArguments

    hf = {k: v for k, v in recipe.training.model_dump().items() if k not in SpecArgs.model_fields}
    return TrainingArguments(**{**hf, "use_cpu": True, "report_to": [], "remove_unused_columns": False})


def main() -> None:
    args = runner.parser("modelopt", __doc__).parse_args()
    run = runner.start("modelopt", args)
    if run is None:
        return
    import modelopt.torch.speculative as mtsp
    from modelopt.torch.export import export_speculative_decoding
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset
    from modelopt.torch.speculative.plugins import HFEagleModel
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer

    recipe = load(run, AutoConfig.from_pretrained(run.plan["target"]))
    (run.run_dir / "recipe.json").write_text(json.dumps(recipe.model_dump(mode="json"), indent=2, default=str))
    model = AutoModelForCausalLM.from_pretrained(run.plan["target"], dtype="auto")  # main.py's load
    mtsp.convert(model, [("eagle", recipe.eagle.model_dump())])
    HFEagleModel.load_draft_vocab_cache(model, recipe.data.draft_vocab_cache)

    files = sorted(str(p) for p in Path(run.me["data"]).glob("*.pt"))
    targs = training_arguments(recipe, run)
    trainer = Trainer(model=model, args=targs,
                      train_dataset=OfflineSupervisedDataset(files, answer_only_loss=recipe.training.answer_only_loss),
                      data_collator=EagleOfflineDataCollator(train_len=run.me["longest_row"]))
    result = trainer.train()
    export_speculative_decoding(model, export_dir=str(run.run_dir / "export"))
    runner.finish(run, run.run_dir / "export", steps=result.global_step, train_loss=result.training_loss,
                  train_runtime_s=result.metrics.get("train_runtime"), padded_to=run.me["longest_row"],
                  precision={"weights": str(next(model.eagle_module.parameters()).dtype), "bf16_autocast": targs.bf16})


if __name__ == "__main__":
    main()
