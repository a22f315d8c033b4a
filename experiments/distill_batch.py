"""Greedy distill batches: transformers' ``generate`` (finished rows keep decoding until the batch's
longest answer ends) against headway's ``greedy_batch`` (finished rows leave the KV cache), on the
same prompts in the same process, batches interleaved with the order alternating. Reports tokens/s
of each, their ratio, and how many answers came out token-identical (in bf16 a different batch
shape can flip a near-tie; in fp32 the two are equal, see tests/test_data_distill.py).

    python experiments/distill_batch.py [--target smollm2] [--prompts chat:extra] [--num 128] [--batch 64]

Not part of headway: a measurement. The SmolLM2 run: benchmarks/results/smollm2-6k/distill-batch.txt.
"""
import argparse
import time

import torch

from headway.data.chat import load_chat_template
from headway.data.generation import SamplingSettings, generate_batch, greedy_batch, stop_token_ids
from headway.data.plans import prompt_ids
from headway.data.distill import generation_dtype
from headway.data.sources import read_samples
from headway.target import load_target, resolve_target_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--prompts", default="chat:extra")
    ap.add_argument("--num", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    args = ap.parse_args()
    dtype = generation_dtype("auto", torch.device("cpu"))
    model, tok = load_target(str(resolve_target_path(args.target)), dtype=dtype)
    template = load_chat_template(tok, None)
    samples = read_samples(args.prompts, tokenizer=tok, limit=args.num).samples
    prompts = [prompt_ids(s, tok, template, "auto", args.target)[0] for s in samples]
    stops = stop_token_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else stops[0]
    settings = SamplingSettings(max_new_tokens=args.max_new_tokens)
    run = {"generate": lambda b: generate_batch(model, b, settings, stops, pad),
           "greedy_batch": lambda b: greedy_batch(model, b, args.max_new_tokens, stops, pad)}
    secs = dict.fromkeys(run, 0.0)
    tokens = dict.fromkeys(run, 0)
    same = 0
    for i, start in enumerate(range(0, len(prompts), args.batch)):
        batch = prompts[start: start + args.batch]
        answers = {}
        for name in (list(run) if i % 2 == 0 else list(run)[::-1]):
            t = time.perf_counter()
            answers[name] = run[name](batch)
            secs[name] += time.perf_counter() - t
            tokens[name] += sum(len(a.tokens) for a in answers[name])
        same += sum(a == b for a, b in zip(answers["generate"], answers["greedy_batch"]))
        print(f"batch {i}: " + ", ".join(f"{n} {secs[n]:.0f} s" for n in run), flush=True)
    print(f"{args.target} {dtype} · {len(prompts)} prompts of {args.prompts} · batch {args.batch} · "
          f"{args.max_new_tokens} new tokens at most · {torch.get_num_threads()} threads")
    for n in run:
        print(f"{n:>13}: {tokens[n] / secs[n]:6.1f} tok/s ({tokens[n]} tokens in {secs[n]:.1f} s)")
    rate = {n: tokens[n] / secs[n] for n in run}
    print(f"greedy_batch / generate: {rate['greedy_batch'] / rate['generate']:.2f}x;"
          f" identical answers {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
