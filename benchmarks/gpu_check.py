"""CUDA check for the tree decoder (run whenever a GPU is at hand; < 8 minutes on one H200).

1. Exactness: greedy speculative output == ``model.generate(do_sample=False)`` on CUDA in fp32
   (TF32 off) for every fixture architecture x head kind x tree shape, dynamic and static KV
   cache, with drafts from an oracle that is right most of the time, so acceptance paths of every
   length are exercised.
2. Speed on an 8B-shaped target (Llama-3-8B geometry, random weights, bf16, nothing downloaded):
   the verify-cost curve t(n)/t(1) for n = 1..64 (on a GPU it should stay ~1x for dozens of
   tokens), HF greedy tokens/s, the decoder's step split (draft / verify / other, ms per step)
   per tree shape and runtime (dynamic cache, static cache; ``--compile`` adds torch.compile),
   and the projected speedup at each ``--tau``: tau tokens per step / (step time x HF tokens/s).
   The heads are random (tau ~1 here): the split is what a step costs, tau comes from training.

``--dry-run`` runs the same code on CPU with a tiny geometry in seconds (tests run it).
Writes a JSON report to $OUT (or ./gpu_check.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny geometry on CPU, no exactness sweep (seconds)")
    ap.add_argument("--tau", type=float, nargs="+", default=[2.0, 3.0, 4.0], help="taus to project speedup at")
    ap.add_argument("--skip-exact", action="store_true", help="skip the fixture exactness sweep")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile (minutes of compilation)")
    ap.add_argument("--new-tokens", type=int, default=128)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: nothing to check (--dry-run runs the tiny CPU version)", file=sys.stderr)
        return 1
    dev = torch.device("cpu" if args.dry_run else "cuda")
    report: dict = {"device": "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(0), "exact": {}}
    if not (args.dry_run or args.skip_exact):
        report["exact"] = exactness(dev)
        print(f"exactness: all={all(v == 1.0 for v in report['exact'].values())}", flush=True)
    report["exact_all"] = all(v == 1.0 for v in report["exact"].values())
    runtimes = ("dynamic", "static") + (("compile",) if args.compile else ())
    t0 = time.time()
    if args.dry_run:
        report["big"] = big_report(TINY, dev, torch.float32, list(range(1, 9)), 16, 8, args.tau, reps=1,
                                   shapes=(("medusa", "chain-3"), ("eagle3", "dynamic-4-3-8")), runtimes=runtimes)
    else:
        torch.backends.cuda.matmul.allow_tf32 = True  # speed section: the kernels a user gets
        report["big"] = big_report(LLAMA3_8B, dev, torch.bfloat16, list(range(1, 65)), 512, args.new_tokens,
                                   args.tau, reps=5, runtimes=runtimes)
    report["big_seconds"] = time.time() - t0
    out_dir = Path(os.environ.get("OUT", "."))
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    return 0 if report["exact_all"] else 2


def exactness(dev: torch.device) -> dict[str, float]:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from test_decode_exact import KINDS, SHAPES, OracleProposer, make_heads, prompts

    from headway.decode import Speculator
    from headway.decode.proposers import make_proposer
    from headway.testing import ARCHITECTURES, tiny_target

    exact: dict[str, float] = {}
    for arch in ARCHITECTURES:
        model, tok = tiny_target(arch)
        model.to(dev)
        ps = prompts(tok, n=5)
        refs = [reference_cuda(model, p, 40) for p in ps]
        for kind in KINDS:
            heads = make_heads(kind, model)
            for shape in SHAPES:
                for static in (False, True):
                    spec = Speculator(model, tok, heads, tree=shape, static_cache=static)
                    ok = 0
                    for p, ref in zip(ps, refs):
                        spec.new_proposer = lambda: OracleProposer(make_proposer(spec.heads), ref, len(p),
                                                                   model.config.vocab_size)
                        ok += spec.generate(p, max_new_tokens=40).ids == ref
                    exact[f"{arch}/{kind}/{shape}/{'static' if static else 'dynamic'}"] = ok / len(ps)
        print(f"{arch}: {[v for k, v in exact.items() if k.startswith(arch)]}", flush=True)
    return exact


# -- the 8B-shaped section: verify cost, HF greedy, the decoder's step split, projected speedup --
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=384, max_position_embeddings=512)
BIG_SHAPES = (("medusa", "mc_sim_7b_63"), ("eagle3", "dynamic-8-6-48"), ("eagle3", "chain-5"), ("eagle1", "chain-5"))


def big_target(geometry: dict, device: torch.device, dtype: torch.dtype):
    """A random-weight Llama of this geometry, built on the device (no download)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**geometry, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval().requires_grad_(False)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def verify_cost(model, prefix: int, ns: list[int], reps: int) -> dict[int, float]:
    """Median seconds of one n-token tree-shaped forward after a ``prefix``-token cache, per n
    (causal tree: the cost does not depend on the tree's shape, only on n)."""
    from headway.compat import cache_kwarg
    from headway.decode.kv import keep_accepted, new_cache
    from headway.decode.tree import tree_mask

    dev, V = model.device, model.config.vocab_size
    cache = new_cache(model.config)
    model(input_ids=torch.randint(3, V, (1, prefix), device=dev), **{cache_kwarg(): cache}, use_cache=True)
    cost = {}
    for n in ns:
        mask = tree_mask(torch.ones(n, n, dtype=torch.bool, device=dev).tril(), prefix, model.dtype)
        pos = (torch.arange(n, device=dev) + prefix)[None]
        times = []
        for _ in range(reps + 1):  # the first is a warm-up
            tok = torch.randint(3, V, (1, n), device=dev)
            sync(dev)
            t = time.perf_counter()
            model(input_ids=tok, **{cache_kwarg(): cache}, use_cache=True, attention_mask=mask,
                  position_ids=pos)
            sync(dev)
            times.append(time.perf_counter() - t)
            keep_accepted(cache, prefix, n, torch.zeros(0, dtype=torch.long, device=dev))  # roll back
        cost[n] = sorted(times[1:])[reps // 2]
    return cost


def big_report(geometry: dict, device: torch.device, dtype: torch.dtype, ns: list[int], prompt_len: int,
               new_tokens: int, taus: list[float], reps: int, shapes=BIG_SHAPES, runtimes=("dynamic",)) -> dict:
    from test_decode_exact import make_heads

    from headway.decode import Speculator
    from headway.testing import tiny_tokenizer

    model = big_target(geometry, device, dtype)
    out: dict = {"geometry": geometry, "dtype": str(dtype), "parameters": sum(p.numel() for p in model.parameters())}
    cost = verify_cost(model, prompt_len, ns, reps)
    out["verify_seconds"] = cost
    out["verify_cost_ratio"] = {n: cost[n] / cost[1] for n in cost}  # t(n) / t(1)
    print("verify t(n)/t(1):", {n: round(v, 2) for n, v in out["verify_cost_ratio"].items()}, flush=True)
    prompt = torch.randint(3, geometry["vocab_size"], (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    reference_cuda(model, prompt, 8)  # warm-up
    sync(device)
    t = time.perf_counter()
    reference_cuda(model, prompt, new_tokens)
    sync(device)
    hf = new_tokens / (time.perf_counter() - t)
    out["hf_greedy_tokens_per_s"] = hf
    print(f"HF greedy: {hf:.1f} tok/s", flush=True)
    tok = tiny_tokenizer()
    out["decoder"] = {}
    for kind, shape in shapes:
        heads = make_heads(kind, model)
        for runtime in runtimes:
            spec = Speculator(model, tok, heads, tree=shape, static_cache=runtime != "dynamic",
                              compile=runtime == "compile")
            spec.generate(prompt, max_new_tokens=8)  # warm-up (and compilation)
            st = spec.generate(prompt, max_new_tokens=new_tokens).stats
            steps = max(st.target_forwards, 1)
            other = st.time_total - st.time_prefill - st.time_draft - st.time_verify
            step = (st.time_total - st.time_prefill) / steps  # seconds per decoder step
            row = {"tree_size": spec.tree.size, "steps": steps, "tau_random_heads": st.tau,
                   "step_ms": 1e3 * step, "draft_ms": 1e3 * st.time_draft / steps,
                   "verify_ms": 1e3 * st.time_verify / steps, "other_ms": 1e3 * other / steps,
                   # tau tokens per step against HF's one token per 1/hf seconds
                   "projected_speedup": {str(tau): tau / (step * hf) for tau in taus}}
            out["decoder"][f"{kind}/{shape}/{runtime}"] = row
            print(kind, shape, runtime, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()},
                  flush=True)
    return out


def reference_cuda(model, ids, n):
    x = torch.tensor([ids], device=model.device)
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                             pad_token_id=2, eos_token_id=None)
    return out[0, len(ids):].tolist()


if __name__ == "__main__":
    sys.exit(main())
