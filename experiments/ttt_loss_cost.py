"""What the EAGLE-3 training-time-test loss costs around the drafter: its forward and backward on one
batch the size of the SmolLM2 recipes' (16 rows x 300 tokens, answers on the last ~55%, an 8,192-row
draft vocabulary, 3 steps), with ``eagle3_ttt_loss`` as of REV and as it is now, interleaved, median
of 5. Both give the same loss and gradients (``tests/test_train_eagle_ttt.py``); this is only their time.

    python experiments/ttt_loss_cost.py [THREADS [REV]]   # default: 2, 0707fee (before the per-row softmax)
"""
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from headway.heads import Eagle3Drafter
from headway.target import load_target, resolve_target_path
from headway.train.ttt import eagle3_ttt_loss

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
rev = sys.argv[2] if len(sys.argv) > 2 else "0707fee"
torch.set_num_threads(threads)
src = Path(tempfile.mkdtemp()) / "ttt_before.py"
src.write_text(subprocess.run(["git", "show", f"{rev}:headway/train/ttt.py"], check=True, capture_output=True,
                              text=True, cwd=Path(__file__).parent).stdout.replace("from ..", "from headway."))
spec = importlib.util.spec_from_file_location("ttt_before", src)
before = importlib.util.module_from_spec(spec)
spec.loader.exec_module(before)

target, _ = load_target(str(resolve_target_path("smollm2")), dtype="float32")  # `headway target build smollm2`
drafter = Eagle3Drafter.for_target(target, draft_vocab_size=8192)
B, T, H = 16, 300, 576
torch.manual_seed(0)
ids = torch.randint(0, 8192, (B, T))
loss_mask = torch.zeros(B, T, dtype=torch.long)
loss_mask[:, 135:] = 1
fused = torch.randn(B, T, H)
logits = torch.randn(B, T, 8192)
top = torch.randint(0, 8192, (B, T))
print(f"# {threads} thread(s); batch {B} x {T}, draft vocab 8192, 3 steps, hard_weight 1; before = {rev}")
times: dict[str, list[float]] = {"before": [], "now": []}
for _ in range(5):
    for name, fn in (("before", before.eagle3_ttt_loss), ("now", eagle3_ttt_loss)):
        drafter.zero_grad()
        t = time.perf_counter()
        loss, _ = fn(drafter, ids, fused, logits, loss_mask, steps=3, decay=0.8, hard_weight=1.0, target_top=top)
        loss.backward()
        times[name].append(time.perf_counter() - t)
b, a = (1e3 * sorted(times[k])[2] for k in ("before", "now"))
print(f"loss forward + backward: before {b:.0f} ms, now {a:.0f} ms ({a / b:.2f}x)")
