"""CUDA check for the tree decoder (run whenever a GPU is at hand; < 5 minutes on one GPU).

1. Exactness: greedy speculative output == ``model.generate(do_sample=False)`` on CUDA in fp32
   (TF32 off) for every fixture architecture x head kind x tree shape, with drafts from an oracle
   that is right most of the time, so acceptance paths of every length are exercised.
2. Speed: a ~0.5B-parameter random Llama on the GPU; per tree size, the cost of one verify forward
   relative to a 1-token forward (on a GPU it should stay ~1x up to dozens of tokens), and
   tokens/s of the decoder with the oracle drafter vs HF greedy generate.
Writes a JSON report to $OUT (or ./gpu_check.json).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from test_decode_exact import KINDS, SHAPES, OracleProposer, make_heads, prompts, reference

    from headway.decode import Speculator
    from headway.decode.proposers import make_proposer
    from headway.testing import ARCHITECTURES, tiny_target

    dev = torch.device("cuda")
    report: dict = {"device": torch.cuda.get_device_name(0), "exact": {}, "speed": {}}
    t0 = time.time()
    for arch in ARCHITECTURES:
        model, tok = tiny_target(arch)
        model.to(dev)
        ps = prompts(tok, n=5)
        refs = [reference_cuda(model, p, 40) for p in ps]
        for kind in KINDS:
            heads = make_heads(kind, model)
            for shape in SHAPES:
                spec = Speculator(model, tok, heads, tree=shape)
                ok = 0
                for p, ref in zip(ps, refs):
                    spec.new_proposer = lambda: OracleProposer(make_proposer(spec.heads), ref, len(p),
                                                               model.config.vocab_size)
                    ok += spec.generate(p, max_new_tokens=40).ids == ref
                report["exact"][f"{arch}/{kind}/{shape}"] = ok / len(ps)
        print(f"{arch}: {[v for k, v in report['exact'].items() if k.startswith(arch)]}", flush=True)
    report["exact_all"] = all(v == 1.0 for v in report["exact"].values())
    report["exact_seconds"] = time.time() - t0

    from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

    from headway.decode.tree import additive_mask
    from headway.testing import tiny_tokenizer

    cfg = LlamaConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                      num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096)
    big = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(dev).eval()
    ids = torch.randint(3, 32000, (1, 512), device=dev)
    cost = {}
    with torch.inference_mode():
        for n in (1, 4, 8, 16, 32, 64, 128):
            times = []
            for _ in range(10):
                cache = DynamicCache(config=cfg)
                big(input_ids=ids, cache=cache, use_cache=True)
                mask = additive_mask(torch.ones(n, n, dtype=torch.bool, device=dev).tril(), 512, torch.bfloat16)
                tok = torch.randint(3, 32000, (1, n), device=dev)
                torch.cuda.synchronize()
                t = time.perf_counter()
                big(input_ids=tok, cache=cache, use_cache=True, attention_mask=mask,
                    position_ids=(torch.arange(n, device=dev) + 512)[None])
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            cost[n] = sorted(times)[len(times) // 2]
    report["speed"]["verify_cost_ratio"] = {n: cost[n] / cost[1] for n in cost}
    print("verify cost vs 1 token:", {n: round(v, 2) for n, v in report["speed"]["verify_cost_ratio"].items()})

    tok = tiny_tokenizer()
    prompt = ids[0, :128].tolist()
    ref = reference_cuda(big, prompt, 128)
    t = time.perf_counter()
    reference_cuda(big, prompt, 128)
    torch.cuda.synchronize()
    base = 128 / (time.perf_counter() - t)
    for kind, shape in (("medusa", "mc_sim_7b_63"), ("eagle3", "dynamic-8-6-48"), ("eagle1", "chain-5")):
        spec = Speculator(big, tok, make_heads(kind, big), tree=shape)
        spec.new_proposer = lambda: OracleProposer(make_proposer(spec.heads), ref, len(prompt), 32000)
        spec.generate(prompt, max_new_tokens=16)
        out = spec.generate(prompt, max_new_tokens=128)
        report["speed"][f"{kind}/{shape}"] = {"tokens_per_s": out.stats.tokens_per_s, "hf_greedy": base,
                                             "tau": out.stats.tau, "overhead_share":
                                                 1 - (out.stats.time_verify + out.stats.time_draft) /
                                                 max(out.stats.time_total - out.stats.time_prefill, 1e-9)}
        print(kind, shape, report["speed"][f"{kind}/{shape}"], flush=True)
    out_dir = Path(os.environ.get("OUT", "."))
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    return 0 if report["exact_all"] else 2


def reference_cuda(model, ids, n):
    x = torch.tensor([ids], device=model.device)
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                             pad_token_id=2, eos_token_id=None)
    return out[0, len(ids):].tolist()


if __name__ == "__main__":
    sys.exit(main())
