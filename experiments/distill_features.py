"""What ``headway distill --features`` saves: greedy distill batches with and without keeping the
hidden states (runs alternating, in one process), against a features pass over the same rows
(``headway features``' forward: right-padded rows, its batch size), all on the same prompts.

    python experiments/distill_features.py [--target smollm2] [--prompts chat:train] [--num 64] [--batch 64]

Reports seconds per generated token of each, the cost of keeping the states, and how much of
distil + features the fused run saves. Not part of headway: a measurement. The SmolLM2 run:
benchmarks/results/smollm2-xeon/distill-features.txt.
"""
import argparse
import time

import torch

from headway.data.chat import load_chat_template
from headway.data.distill import generation_dtype
from headway.data.features import (STORE_DTYPES, layer_indices, layer_key, parse_layers, right_pad,
                                   target_features)
from headway.data.generation import FeatureSpec, greedy_batch, stop_token_ids
from headway.data.plans import prompt_ids
from headway.data.sources import read_samples
from headway.target import load_target, resolve_target_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--prompts", default="chat:train")
    ap.add_argument("--num", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--layers", nargs="+", default=["eagle3", "final"])
    ap.add_argument("--features-batch", type=int, default=8, help="headway features' batch size (its recipes': 8)")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    dtype = generation_dtype("auto", torch.device("cpu"))
    model, tok = load_target(str(resolve_target_path(args.target)), dtype=dtype)
    template = load_chat_template(tok, None)
    samples = read_samples(args.prompts, tokenizer=tok, limit=args.num).samples
    prompts = sorted((prompt_ids(s, tok, template, "auto", args.target)[0] for s in samples), key=len)  # as distill
    stops = stop_token_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else stops[0]
    n_layers = model.config.num_hidden_layers
    layers = parse_layers(args.layers, n_layers)
    spec = FeatureSpec(layer_indices(layers, n_layers), STORE_DTYPES["bfloat16"])
    run = {"plain": None, "with features": spec}
    secs = dict.fromkeys(run, 0.0)
    rows: list[list[int]] = []
    for rep in range(args.repeats):
        for name in (list(run) if rep % 2 == 0 else list(run)[::-1]):
            t = time.perf_counter()
            answers = [a for b in range(0, len(prompts), args.batch)
                       for a in greedy_batch(model, prompts[b: b + args.batch], args.max_new_tokens, stops, pad,
                                             run[name])]
            secs[name] += time.perf_counter() - t
            if name == "plain":
                rows = [p + a.tokens for p, a in zip(prompts, answers)]
            print(f"repeat {rep}: {name} {time.perf_counter() - t:.1f} s", flush=True)
    generated = sum(len(r) for r in rows) - sum(len(p) for p in prompts)
    t = time.perf_counter()
    for b in range(0, len(rows), args.features_batch):
        batch = rows[b: b + args.features_batch]
        ids, mask = right_pad(batch, pad, torch.device("cpu"))
        feats = target_features(model, ids, mask, layers)
        for k in feats:  # what headway features stores
            _ = [feats[k][i, : len(r)].to(torch.bfloat16) for i, r in enumerate(batch)]
    pass_s = time.perf_counter() - t
    per = {n: secs[n] / args.repeats for n in run}
    print(f"{args.target} {dtype} · {len(prompts)} prompts of {args.prompts} · batch {args.batch} · "
          f"{args.max_new_tokens} new tokens at most · layers {[layer_key(l) for l in layers]} · "
          f"{torch.get_num_threads()} threads · {args.repeats} repeats alternating")
    print(f"{generated} generated tokens, {sum(len(r) for r in rows)} in the rows")
    for n in run:
        print(f"  distill, {n:>13}: {per[n]:6.1f} s ({generated / per[n]:.1f} generated tok/s)")
    print(f"  features pass (batch {args.features_batch}): {pass_s:6.1f} s "
          f"({sum(len(r) for r in rows) / pass_s:.0f} row tok/s)")
    print(f"keeping the states costs {per['with features'] / per['plain'] - 1:+.1%} of the distill; "
          f"distill + features pass {per['plain'] + pass_s:.1f} s -> fused {per['with features']:.1f} s "
          f"({1 - per['with features'] / (per['plain'] + pass_s):.0%} less)")


if __name__ == "__main__":
    main()
