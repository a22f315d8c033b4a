"""The harness's first step: one headway dataset + its features folder -> every peer's input, the same
rows, loss masks, aux layers and draft vocabulary, plus a ``plan.json`` the runners read.

The plan holds each tool's settings in both modes (``defaults.py``): ``own`` (each peer at its own
defaults, its epochs capped only by ``--own-epochs-cap``) and ``shared`` (one draft vocabulary of ``--draft-vocab``,
``--ttt-steps``, ``--epochs``, each tool's recommended LR unless ``--lr`` is given). A runner picks one
with ``--defaults``; the converted data is the same for both.

    python benchmarks/peers/prepare.py --data runs/distill-demo --features runs/peers/features \\
        --target ~/.cache/headway/targets/demo-... --aux 2 4 5 --draft-vocab 2048 --rows 64 --out runs/peers

Output::

    OUT/plan.json                    rows, tokens, aux ids per tool, vocab files per size, settings per mode
    OUT/speculators/data/            datasets folder + hidden_states/hs_{i}.safetensors
    OUT/speculators/{d2t,t2d}-N.npy  the draft vocabulary of size N (one pair per size a mode uses)
    OUT/modelopt/data/sample_*.pt    ModelOpt's offline dump layout; OUT/modelopt/d2t-N.pt
    OUT/specforge/data/data_*.ckpt   SpecForge's offline capture layout; OUT/specforge/vocab_mapping-N.pt
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
import defaults  # noqa: E402

RECOMMENDED_LR = defaults.RECOMMENDED_LR


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


def settings(peers: list[str], draft_vocab: int, epochs: int, ttt_steps: int, lr: float | None,
             own_epochs_cap: int | None = None) -> dict:
    """{mode: {peer: settings}} for the plan (defaults.py)."""
    return {"own": {p: defaults.own(p, own_epochs_cap) for p in peers},
            "shared": {p: defaults.shared(p, draft_vocab, epochs, ttt_steps, lr) for p in peers}}


def vocab_sizes(plan_settings: dict, peer: str) -> list[int]:
    return sorted({plan_settings[mode][peer]["draft_vocab_size"] for mode in plan_settings})


def write_peer(peer: str, rows: list, out: Path, args: argparse.Namespace, sizes: list[int]) -> dict:
    """Convert the rows for ``peer`` and write its draft vocabulary at every size -> the plan's entry."""
    me = out / peer
    entry: dict = {"aux_ids": convert.peer_layer_ids(args.aux, peer), "vocab": {}}
    for n in sizes:
        d2t, t2d = convert.draft_vocab_mapping(args.data, n)
        if peer == "speculators":
            a, b = convert.write_vocab_npy(d2t, t2d, me)
            entry["vocab"][str(n)] = {"d2t": str(a), "t2d": str(b)}
        elif peer == "modelopt":
            me.mkdir(parents=True, exist_ok=True)
            torch.save(d2t.clone(), me / f"d2t-{n}.pt")  # the tensor itself: load_draft_vocab_cache's format
            entry["vocab"][str(n)] = {"d2t": str(me / f"d2t-{n}.pt")}
        else:
            me.mkdir(parents=True, exist_ok=True)
            torch.save({"d2t": d2t, "t2d": t2d}, me / f"vocab_mapping-{n}.pt")
            entry["vocab"][str(n)] = {"mapping": str(me / f"vocab_mapping-{n}.pt")}
    if peer == "speculators":
        eps = float(json.loads((Path(args.target) / "config.json").read_text()).get("rms_norm_eps", 1e-6))
        # its loader insists on a validation split (train_data_ratio in (0, 1)): one extra row, a copy of
        # the last, and a ratio that keeps exactly the N rows for training
        entry["data"] = str(convert.write_speculators(rows + rows[-1:], me / "data", final_norm_weight(args.target), eps))
        entry["train_data_ratio"] = (len(rows) + 0.5) / (len(rows) + 1)
    elif peer == "modelopt":
        entry["data"] = str(convert.write_modelopt(rows, me / "data"))
        entry["longest_row"] = max(len(r.input_ids) for r in rows)
    else:
        entry["data"] = str(convert.write_specforge(rows, me / "data"))
        entry["target"] = str(specforge_target(args.target, me / "target"))
    return entry


def merge_plans(old: dict, new: dict) -> dict:
    """``new`` with the peers an earlier prepare.py wrote into the same folder kept listed (their data,
    settings and LR), when both were made from the same rows with the same shared settings; else ``new``."""
    keys = ("features", "rows", "tokens", "draft_vocab_size", "aux_hf_index", "epochs")
    if not (all(old.get(k) == new[k] for k in keys) and "settings" in old):
        return new
    merged = {**new, "peers": {**old["peers"], **new["peers"]}, "lr": {**old.get("lr", {}), **new["lr"]},
              "settings": {mode: {**old["settings"].get(mode, {}), **new["settings"].get(mode, {})}
                           for mode in {*old["settings"], *new["settings"]}}}
    return merged


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="headway distilled dataset (its token counts give the draft vocab)")
    ap.add_argument("--features", required=True, help="headway features folder with hidden_states.{aux} and final")
    ap.add_argument("--target", required=True, help="target folder")
    ap.add_argument("--aux", type=int, nargs=3, required=True, help="HF hidden-state indices (headway's numbering)")
    ap.add_argument("--draft-vocab", type=int, required=True, help="the shared mode's draft vocabulary size")
    ap.add_argument("--rows", type=int, default=None, help="first N rows only")
    ap.add_argument("--max-length", type=int, default=None)
    ap.add_argument("--epochs", type=int, default=1, help="the shared mode's epochs (every tool's)")
    ap.add_argument("--own-epochs-cap", type=int, default=None,
                    help="cap the own mode's epochs (default: each peer's own, e.g. speculators' 20)")
    ap.add_argument("--ttt-steps", type=int, default=3, help="the shared mode's TTT length")
    ap.add_argument("--lr", type=float, default=None, help="the shared mode's one LR (default: each tool's own)")
    ap.add_argument("--peers", nargs="+", default=list(convert.PEERS), choices=convert.PEERS)
    ap.add_argument("--out", default="runs/peers")
    args = ap.parse_args()

    out = Path(args.out).resolve()  # the runners and the sweep read these paths from other folders
    rows = list(convert.read_rows(args.features, args.aux, args.rows, args.max_length))
    tokens = sum(len(r.input_ids) for r in rows)
    modes = settings(args.peers, args.draft_vocab, args.epochs, args.ttt_steps, args.lr, args.own_epochs_cap)
    plan = {"data": args.data, "features": args.features, "target": str(Path(args.target).resolve()),
            "rows": len(rows), "tokens": tokens, "answer_tokens": int(sum(int(r.loss_mask.sum()) for r in rows)),
            "epochs": args.epochs, "draft_vocab_size": args.draft_vocab, "aux_hf_index": args.aux,
            "lr": {p: args.lr or RECOMMENDED_LR[p] for p in ["headway", *args.peers]},
            "lr_recommended": RECOMMENDED_LR, "settings": modes,
            "peers": {p: write_peer(p, rows, out, args, vocab_sizes(modes, p)) for p in args.peers}}
    if (out / "plan.json").is_file():
        plan = merge_plans(json.loads((out / "plan.json").read_text()), plan)
    (out / "plan.json").write_text(json.dumps(plan, indent=2) + "\n")
    print(f"{len(rows)} rows, {tokens} tokens -> {out}/plan.json")


if __name__ == "__main__":
    main()
