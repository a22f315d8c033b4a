"""One process of tests/test_train_sharded.py's FSDP2 heads check (run by torchrun, 2 CPU processes).

accelerate turns FSDP on for GPUs only, so on CPU the heads train under DDP; this worker shards
the heads itself, as accelerate's FSDP2 does (``fully_shard`` on the trained module's root), and
checks what the loop does with sharded heads: evaluation through the module's forward, the
NaN check shard by shard, and the whole heads gathered for saving. Writes its findings as JSON.
"""

from __future__ import annotations

import gc
import json
import sys
from types import SimpleNamespace

import torch
from accelerate import Accelerator
from torch.distributed.fsdp import fully_shard

from headway.heads import MedusaHeads
from headway.testing import tiny_target
from headway.train.config import TrainConfig
from headway.train.module import TrainModule
from headway.train.guards import non_finite_weight
from headway.train.recipe import TrainRecipe
from headway.train.registry import TASKS
from headway.train.sharding import is_sharded


def build() -> tuple[TrainModule, MedusaHeads]:
    target, _ = tiny_target()
    torch.manual_seed(0)
    task = TASKS["medusa"](TrainConfig(kind="medusa", target="tiny", data="unused"))
    heads = MedusaHeads.for_target(target, num_heads=2)
    with torch.no_grad():  # zero-initialised blocks would hide a wrongly gathered shard
        for p in heads.blocks.parameters():
            p.normal_(0, 0.05)
    return TrainModule(task, heads, target, adapted=False), heads


def main(out: str) -> None:
    acc = Accelerator(cpu=True)
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(3, 384, (2, 12), generator=g), "attention_mask": torch.ones(2, 12).long(),
             "loss_mask": torch.ones(2, 12).long()}
    plain, _ = build()
    want = plain(batch, 0, evaluate=True)
    want_state = {k: v.clone() for k, v in plain.heads.state_dict().items()}

    module, heads = build()
    fully_shard(module)  # what accelerate's FSDP2 does to the trained module: the heads' parameters shard
    found: dict = {"rank": acc.process_index, "sharded": all(is_sharded(p) for p in heads.parameters())}
    got = module(batch, 0, evaluate=True)  # through forward: the weights are whole inside it
    found["eval_equal"] = all(torch.allclose(got[k], want[k], atol=1e-5) for k in want)
    found["nan_before"] = non_finite_weight(module, acc)
    run = SimpleNamespace(inner=SimpleNamespace(heads=heads), accelerator=acc)
    whole = TrainRecipe.whole_heads(run)  # a collective: every process calls it
    if acc.is_main_process:
        state = whole.state_dict()
        found["saved_plain"] = all(type(v) is torch.Tensor for v in state.values())
        found["saved_equal"] = state.keys() == want_state.keys() and all(
            torch.equal(state[k], want_state[k]) for k in want_state)
    else:
        found["whole_elsewhere"] = whole
    module.reshard()  # shards again (FSDP2's root keeps its weights whole after a forward)
    found["sharded_again"] = all(is_sharded(p) for p in heads.parameters())
    if acc.process_index == 1:  # a NaN in rank 1's shard only: every process must name the weight
        with torch.no_grad():
            heads.blocks[1].layers[0].weight.to_local().view(-1)[0] = float("nan")
    found["nan_after"] = non_finite_weight(module, acc)
    with open(f"{out}/rank{acc.process_index}.json", "w") as f:
        json.dump(found, f)
    acc.wait_for_everyone()
    # the group goes down here, not in interpreter teardown, where gloo's threads were sometimes still
    # alive ("terminate called without an active exception", ~1 run in 5)
    del module, heads, whole
    gc.collect()
    acc.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
