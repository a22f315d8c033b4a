"""The harness's first step: one headway dataset + its features folder -> every peer's input, the same
rows, loss masks, aux layers and draft vocabulary, plus a ``plan.json`` the drivers read (so every
trainer gets the same tokens, epochs and draft vocabulary size; learning rates are each tool's own
recommendation unless ``--lr`` is given, and both are recorded).

    python benchmarks/peers/prepare.py --data runs/distill-demo --features runs/peers/features \\
        --target ~/.cache/headway/targets/demo-... --aux 2 4 5 --draft-vocab 2048 --rows 64 --out runs/peers

Output::

    OUT/plan.json                    settings + per-peer aux ids (each tool's numbering) + recommended LRs
    OUT/speculators/data/            datasets folder + hidden_states/hs_{i}.safetensors (+ d2t/t2d .npy)
    OUT/modelopt/data/sample_*.pt    ModelOpt's offline dump layout
    OUT/specforge/data/data_*.ckpt   SpecForge's offline capture layout
    OUT/specforge/target/            the target with model.safetensors.index.json (SpecForge's TargetHead
                                     finds lm_head through it), the same weights linked
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import convert  # noqa: E402  (the harness folder is not a package)

# Each tool's documented default learning rate for EAGLE-3 (what its users would run).
RECOMMENDED_LR = {"headway": 2e-3, "speculators": 1e-3, "modelopt": 1e-4, "specforge": 1e-4}


def final_norm_weight(target_dir: str) -> torch.Tensor:
    """The target's final RMSNorm weight (speculators' slot 3 is stored as the pre-norm equivalent)."""
    from safetensors import safe_open

    for f in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            if "model.norm.weight" in st.keys():
                return st.get_tensor("model.norm.weight").float()
    raise SystemExit(f"prepare.py: error: {target_dir} has no model.norm.weight in its safetensors files")


def specforge_target(target_dir: str, out: Path) -> Path:
    """The target folder as SpecForge's TargetHead reads it: files linked, plus an index.json."""
    from safetensors import safe_open

    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for f in Path(target_dir).iterdir():
        if f.is_file() and not (out / f.name).exists():
            os.symlink(f.resolve(), out / f.name)
        if f.suffix == ".safetensors":
            with safe_open(str(f), "pt") as st:
                weight_map.update({k: f.name for k in st.keys()})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="headway distilled dataset (its token counts give the draft vocab)")
    ap.add_argument("--features", required=True, help="headway features folder with hidden_states.{aux} and final")
    ap.add_argument("--target", required=True, help="target folder")
    ap.add_argument("--aux", type=int, nargs=3, required=True, help="HF hidden-state indices (headway's numbering)")
    ap.add_argument("--draft-vocab", type=int, required=True)
    ap.add_argument("--rows", type=int, default=None, help="first N rows only")
    ap.add_argument("--max-length", type=int, default=None)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=None, help="one LR for all (default: each tool's own)")
    ap.add_argument("--peers", nargs="+", default=list(convert.PEERS), choices=convert.PEERS)
    ap.add_argument("--out", default="runs/peers")
    args = ap.parse_args()

    out = Path(args.out)
    rows = list(convert.read_rows(args.features, args.aux, args.rows, args.max_length))
    d2t, t2d = convert.draft_vocab_mapping(args.data, args.draft_vocab)
    tokens = sum(len(r.input_ids) for r in rows)
    plan = {"data": args.data, "features": args.features, "target": str(Path(args.target).resolve()),
            "rows": len(rows), "tokens": tokens, "answer_tokens": int(sum(int(r.loss_mask.sum()) for r in rows)),
            "epochs": args.epochs, "draft_vocab_size": args.draft_vocab, "aux_hf_index": args.aux,
            "lr": {p: args.lr or RECOMMENDED_LR[p] for p in ["headway", *args.peers]},
            "lr_recommended": RECOMMENDED_LR, "peers": {}}
    if "speculators" in args.peers:
        eps = float(json.loads((Path(args.target) / "config.json").read_text()).get("rms_norm_eps", 1e-6))
        # its loader insists on a validation split (train_data_ratio in (0, 1)): one extra row, a copy of
        # the last, and a ratio that keeps exactly the N rows for training
        d = convert.write_speculators(rows + rows[-1:], out / "speculators" / "data", final_norm_weight(args.target),
                                      eps)
        a, b = convert.write_vocab_npy(d2t, t2d, out / "speculators")
        plan["peers"]["speculators"] = {"data": str(d), "d2t": str(a), "t2d": str(b),
                                        "train_data_ratio": (len(rows) + 0.5) / (len(rows) + 1),
                                        "aux_ids": convert.peer_layer_ids(args.aux, "speculators")}
    if "modelopt" in args.peers:
        d = convert.write_modelopt(rows, out / "modelopt" / "data")
        torch.save(d2t.clone(), out / "modelopt" / "d2t.pt")  # the tensor itself: load_draft_vocab_cache's format
        plan["peers"]["modelopt"] = {"data": str(d), "d2t": str(out / "modelopt" / "d2t.pt"),
                                     "aux_ids": convert.peer_layer_ids(args.aux, "modelopt")}
    if "specforge" in args.peers:
        d = convert.write_specforge(rows, out / "specforge" / "data")
        torch.save({"d2t": d2t, "t2d": t2d}, out / "specforge" / "vocab_mapping.pt")
        tgt = specforge_target(args.target, out / "specforge" / "target")
        plan["peers"]["specforge"] = {"data": str(d), "target": str(tgt),
                                      "vocab_mapping": str(out / "specforge" / "vocab_mapping.pt"),
                                      "aux_ids": convert.peer_layer_ids(args.aux, "specforge")}
    if (out / "plan.json").is_file():  # peers prepared earlier with the same settings stay listed
        old = json.loads((out / "plan.json").read_text())
        same = all(old.get(k) == plan[k] for k in ("features", "rows", "tokens", "draft_vocab_size", "aux_hf_index"))
        plan["peers"] = {**(old["peers"] if same else {}), **plan["peers"]}
    (out / "plan.json").write_text(json.dumps(plan, indent=2) + "\n")
    print(f"{len(rows)} rows, {tokens} tokens -> {out}/plan.json")


if __name__ == "__main__":
    main()
