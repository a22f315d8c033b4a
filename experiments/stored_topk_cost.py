"""What soft labels from stored top-k logits (``headway features --topk_logits 64``, ``eagle.soft_labels:
stored_topk``) save per offline training step against projecting the stored ``final`` state through the
lm_head. A random SmolLM2-shaped target (hidden 576, 49,152-token vocabulary; nothing to build or
download), one batch the size of the SmolLM2 recipes' (16 rows x 300 tokens, answers on the last ~55%,
bf16 stored states), the 1,536-answer recipes' heads (8,192-row draft vocabulary; EAGLE-3 3 steps,
DFlash blocks of 4 at 64 anchors, hard_weight 1). A step is what the loop does with a stored batch:
the logits (``stored_batch``), the loss, its backward and an AdamW step. The variants run interleaved,
median of ROUNDS, timed in this process's CPU seconds (``time.process_time``: with one thread, what
other processes on a shared machine do moves it far less than the wall clock); only the ratios mean
anything.

    python experiments/stored_topk_cost.py [THREADS [ROUNDS [ROWS]]]   # default: 1 thread, 9 rounds, 16 rows
"""
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from headway.config import load_config
from headway.data.features import TopkLogits
from headway.heads import DFlashDrafter, Eagle3Drafter
from headway.train.batch import stored_batch
from headway.train.config import TrainConfig
from headway.train.dflash import DFlashTask
from headway.train.eagle import Eagle3Task

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 9
rows = int(sys.argv[3]) if len(sys.argv) > 3 else 16
torch.set_num_threads(threads)
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True,
                  rms_norm_eps=1e-5, rope_theta=100000.0)
target = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
head = target.get_output_embeddings()
B, T, H, V, K = rows, 300, 576, 49152, 64
draft = torch.randperm(V)[:8192].sort().values  # a draft vocabulary
ids = draft[torch.randint(0, 8192, (B, T))]  # (B, T) tokens inside it, as answers mostly are
loss_mask = torch.zeros(B, T, dtype=torch.long)
loss_mask[:, 135:] = 1
layers = [2, 15, 27]
feats = {f"hidden_states.{i}": torch.randn(B, T, H).to(torch.bfloat16) for i in layers}
# greedy data: the target's argmax after each state is the data's next token (inside the draft vocabulary),
# so every variant scores the same positions and differs only in where the logits come from
W = head.weight.detach()
nxt = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # (B, T) x_{s+1}
feats["final"] = (20 * W[nxt] / W[nxt].norm(dim=-1, keepdim=True) + 0.3 * torch.randn(B, T, H)).to(torch.bfloat16)
used = torch.zeros(B, T, dtype=torch.bool)
used[:, :-1] = loss_mask[:, 1:].bool()
feats.update(TopkLogits(target, K)(feats["final"], used))  # what headway features --topk_logits 64 stores
assert torch.equal(feats["topk_indices"][used][:, 0].long(), nxt[used])
batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask, "features": feats}


def setup(kind: str, argmax_from: str, soft: str):
    section = "eagle" if kind == "eagle3" else "dflash"
    c = load_config(TrainConfig, None, {"target": "t", "kind": kind, "features": "f",
                                        f"{section}.argmax_from": argmax_from,
                                        f"{section}.soft_labels": soft, f"{section}.draft_vocab_size": 8192,
                                        f"{section}.hard_weight": 1.0, "eagle.ttt_steps": 3, "dflash.block_size": 4,
                                        "dflash.anchors": 64, f"{section}.aux_layers": layers})
    if kind == "eagle3":
        task, heads = Eagle3Task(c), Eagle3Drafter.for_target(target, draft_vocab_size=8192, aux_layers=layers)
        heads.set_draft_vocab(draft)
    else:
        task = DFlashTask(c)
        heads = DFlashDrafter.for_target(target, mask_token_id=0, block_size=4, aux_layers=layers, draft_vocab=draft)
    logits = task.stored_logits(heads, head)
    opt = torch.optim.AdamW([p for p in heads.parameters() if p.requires_grad], lr=1e-4)
    keys = heads.feature_layers

    def step() -> None:
        tb = stored_batch(batch, keys, logits, torch.device("cpu"), torch.float32)
        loss, _ = task.loss(heads, tb, 0)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


variants = {(kind, f"lm_head, argmax_from={a}" if s == "lm_head" else f"stored top-{K}"): setup(kind, a, s)
            for kind in ("eagle3", "dflash") for a, s in (("data", "lm_head"), ("logits", "lm_head"),
                                                          ("data", "stored_topk"))}
times: dict = {k: [] for k in variants}
for fn in variants.values():
    fn()  # warm up
for _ in range(rounds):
    for k, fn in variants.items():
        t = time.process_time()
        fn()
        times[k].append(time.process_time() - t)
load = os.getloadavg()[0]
print(f"# {threads} thread(s), CPU time, median of {rounds} interleaved rounds; batch {B} x {T}, vocabulary {V}, "
      "draft 8192, "
      f"load average {load:.1f} at the end")
for kind in ("eagle3", "dflash"):
    med = {name: sorted(v)[len(v) // 2] * 1e3 for (k, name), v in times.items() if k == kind}
    ref = med[f"stored top-{K}"]
    print(kind + ": " + "; ".join(f"{name} {ms:.0f} ms ({ms / ref:.2f}x the stored top-{K}'s)"
                                  for name, ms in med.items()))
