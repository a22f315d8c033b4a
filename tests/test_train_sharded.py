"""Training with a sharded frozen target: the accelerate configs, the wrap plan, and FSDP2 on 2 CPU processes."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from headway.heads import load_heads
from headway.testing import save_tiny_target, tiny_target
from headway.heads import Eagle1Drafter
from headway.train.sharding import own_borrowed, shard_plan, sharding_backend

from train_utils import OFFLINE_ENV, REPO, distilled_rows, free_port, records, run_cli, save_rows

CONFIGS = REPO / "configs" / "accelerate"


def test_shard_plan_wraps_each_decoder_layer():
    model, _ = tiny_target()
    assert shard_plan(model) == [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)]


def test_shard_plan_refuses_a_model_without_layer_classes():
    with pytest.raises(ValueError, match="_no_split_modules"):
        shard_plan(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("tied", [False, True])
def test_own_borrowed_gives_the_heads_whole_frozen_copies(tied):
    """Before ZeRO-3 partitions the target, the heads' embeddings and lm_head become their own
    copies: equal values, other tensors, no grad, and a tied weight stays one tensor."""
    model, _ = tiny_target(tie_word_embeddings=tied)
    heads = Eagle1Drafter.for_target(model)
    own_borrowed(heads)
    emb, head = heads.target_embed, heads.target_lm_head
    assert emb is not model.get_input_embeddings() and head is not model.get_output_embeddings()
    assert emb.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    torch.testing.assert_close(emb.weight, model.get_input_embeddings().weight, rtol=0, atol=0)
    torch.testing.assert_close(head.weight, model.get_output_embeddings().weight, rtol=0, atol=0)
    assert not emb.weight.requires_grad and not head.weight.requires_grad
    assert (emb.weight is head.weight) == tied


def fake_accelerator(kind: DistributedType, processes: int = 2, zero_stage: int = 3) -> SimpleNamespace:
    return SimpleNamespace(num_processes=processes, distributed_type=kind,
                           state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=zero_stage)))


def test_sharding_backend_follows_accelerate(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert sharding_backend(fake_accelerator(DistributedType.FSDP)) == "fsdp"
    assert sharding_backend(fake_accelerator(DistributedType.DEEPSPEED)) == "deepspeed"
    assert sharding_backend(fake_accelerator(DistributedType.DEEPSPEED, zero_stage=2)) is None
    assert sharding_backend(fake_accelerator(DistributedType.MULTI_GPU)) is None
    assert sharding_backend(fake_accelerator(DistributedType.MULTI_CPU)) is None
    assert sharding_backend(fake_accelerator(DistributedType.FSDP, processes=1)) is None
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # an FSDP config launched on CPU: accelerate runs DDP
    assert sharding_backend(fake_accelerator(DistributedType.MULTI_CPU)) == "fsdp"


def test_accelerate_configs_load():
    from accelerate.commands.config.config_args import load_config_from_file

    fsdp = load_config_from_file(str(CONFIGS / "fsdp.yaml"))
    assert fsdp.distributed_type == DistributedType.FSDP and fsdp.fsdp_config["fsdp_version"] == 2
    assert "fsdp_transformer_layer_cls_to_wrap" not in fsdp.fsdp_config  # accelerate would look for it in the heads
    ds = load_config_from_file(str(CONFIGS / "deepspeed-zero3.yaml"))
    assert ds.distributed_type == DistributedType.DEEPSPEED
    assert ds.deepspeed_config["zero_stage"] == 3
    assert ds.deepspeed_config["zero3_init_flag"] is False  # the target loads whole; headway partitions it
    for path in (CONFIGS / "fsdp.yaml", CONFIGS / "deepspeed-zero3.yaml"):
        assert f"accelerate launch --config_file configs/accelerate/{path.name} -m headway train" in path.read_text()


# -- 2 CPU processes ---------------------------------------------------------------------------
YAML = """\
target: {target}
data: {data}
kind: eagle1
max_steps: 3
grad_accum: 2
log_every: 1
save_every: 0
eval_fraction: 0.2
progress: false
mixed_precision: "no"
eagle:
  noise: 0  # EAGLE-1's input noise is drawn per process's batch, so it cannot match a 1-process run
"""




@pytest.mark.slow
def test_fsdp_shards_the_target_on_two_cpu_processes_and_matches_one(tmp_path):
    """EAGLE-1 borrows the target's embeddings and lm_head: trained with the FSDP config on 2
    processes, each holds half of every decoder layer, and loss, heads and eval equal 1 process."""
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    assert accelerate, "accelerate launcher not installed next to this python"
    target = save_tiny_target(tmp_path / "target")
    # equal-length, fully supervised rows: each process averages over the same token count
    data = save_rows(tmp_path / "data", distilled_rows(30, 384, seed=3, uniform=True, max_len=16))
    (tmp_path / "c.yaml").write_text(YAML.format(target=target, data=data))
    args = ["--config", str(tmp_path / "c.yaml")]
    one = run_cli(["train", *args, f"output_dir={tmp_path / 'one'}", "batch_size=4"], tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_cli(args + [f"output_dir={tmp_path / 'two'}", "batch_size=2"], tmp_path, timeout=300,
                  launcher=[accelerate, "launch", "--config_file", str(CONFIGS / "fsdp.yaml"), "--num_processes", "2",
                            "--main_process_port", str(free_port()), "-m", "headway", "train"],
                  extra_env={"ACCELERATE_USE_CPU": "1"})
    assert two.returncode == 0, two.stderr[-3000:]

    start1, start2 = records(tmp_path / "one")[0], records(tmp_path / "two")[0]
    assert start1["world_size"] == 1 and start2["world_size"] == 2
    assert start1["global_batch"] == start2["global_batch"] == 8
    assert start1["target_sharding"] is None
    model, _ = tiny_target()
    layers = sum(p.numel() for p in model.model.layers.parameters())
    whole = sum(p.numel() for p in model.parameters())
    shard = start2["target_sharding"]
    assert shard["backend"] == "fsdp" and shard["params"] == whole
    # every decoder layer split in two halves; embeddings, final norm and lm_head whole on each
    assert shard["params_per_rank"] == [whole - layers // 2] * 2

    l1 = [r["loss"] for r in records(tmp_path / "one") if "loss" in r]
    l2 = [r["loss"] for r in records(tmp_path / "two") if "loss" in r]
    assert len(l1) == len(l2) == 3
    torch.testing.assert_close(torch.tensor(l2), torch.tensor(l1), rtol=1e-4, atol=1e-5)
    h1, h2 = load_heads(tmp_path / "one" / "final"), load_heads(tmp_path / "two" / "final")
    s1, s2 = h1.state_dict(), h2.state_dict()
    assert s1.keys() == s2.keys()
    for k, v in s1.items():
        assert type(s2[k]) is torch.Tensor  # saved whole: no DTensor, no shard
        torch.testing.assert_close(s2[k], v, rtol=1e-4, atol=1e-5)
    e1, e2 = h1.metadata["eval"], h2.metadata["eval"]
    assert e1["positions"] == e2["positions"] and e1["tau"] == pytest.approx(e2["tau"], abs=1e-3)


@pytest.mark.slow
def test_fsdp_sharded_heads_evaluate_check_and_save_whole(tmp_path):
    """What accelerate's FSDP does to the heads on GPUs (it has no FSDP on CPU), done by hand on 2
    CPU processes: evaluation through forward equals the unsharded heads, a NaN in one process's
    shard is named on every process, and the saved heads are whole tensors equal to the unsharded."""
    env = {**os.environ, **OFFLINE_ENV, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        "--master_port", str(free_port()), str(REPO / "tests" / "fsdp_heads_worker.py"),
                        str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    found = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    assert [f["rank"] for f in found] == [0, 1]
    for f in found:
        assert f["sharded"] and f["sharded_again"] and f["eval_equal"]
        assert f["nan_before"] is None and f["nan_after"] == "heads.blocks.1.layers.0.weight"
    assert found[0]["saved_plain"] and found[0]["saved_equal"] and found[1]["whole_elsewhere"] is None
