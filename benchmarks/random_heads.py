"""Random-weight heads of every kind for a target folder: a smoke test of the bench pipeline
(acceptance is near zero; the numbers measure overhead, not drafting quality).

    python benchmarks/random_heads.py TARGET_DIR OUT_DIR   # -> OUT_DIR/{medusa,eagle1,eagle3}
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from headway.heads import Eagle1Drafter, Eagle3Drafter, MedusaHeads
from headway.target import load_target


def main(target_dir: str, out_dir: str) -> None:
    target, _ = load_target(target_dir, device="cpu")
    out = Path(out_dir)
    torch.manual_seed(0)
    medusa = MedusaHeads.for_target(target, num_heads=4)
    with torch.no_grad():  # zero-initialised ResBlocks would make every head copy the target's next token
        for p in medusa.blocks.parameters():
            p.normal_(0, 0.05)
    medusa.save_pretrained(out / "medusa")
    Eagle1Drafter.for_target(target).save_pretrained(out / "eagle1")
    Eagle3Drafter.for_target(target, draft_vocab_size=min(512, target.config.vocab_size)).save_pretrained(
        out / "eagle3")
    print(" ".join(str(out / k) for k in ("medusa", "eagle1", "eagle3")))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
