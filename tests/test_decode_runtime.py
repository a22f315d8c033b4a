"""#17: where the decoder runs and how fast: device_map loading, dtype auto, heads in the target's
dtype, the static KV cache and torch.compile. Every path must keep the output exact."""

import pytest
import torch

from headway.sampling import SamplingParams
from test_decode_exact import OracleProposer, make_heads, prompts, reference
from transformers import DynamicCache, StaticCache

from headway.compat import cache_kwarg
from headway.decode import Speculator
from headway.decode.args import DecodeError
from headway.decode.kv import in_place, keep_accepted, new_cache, static_length
from headway.decode.proposers import make_proposer
from headway.decode.tree import tree_mask
from headway.decode.args import DecodeTargetArgs
from headway.target import TargetError, load_dtype, load_target, parse_device_map
from headway.testing import tiny_target

HEAD_KINDS = ["medusa", "eagle1", "eagle3", "dflash", "medusa-vocab"]


@pytest.fixture(scope="module")
def models():
    return {arch: tiny_target(arch) for arch in ("llama", "gpt_neox")}


# -- loading ---------------------------------------------------------------------------------
@pytest.mark.parametrize("device_map", ["cpu", {"": "cpu"}, '{"": "cpu"}'])
def test_device_map_loads_and_decodes_exactly(llama_dir, device_map):
    model, tok = load_target(str(llama_dir), device_map=device_map)
    assert next(model.parameters()).device.type == "cpu" and not model.training
    spec = Speculator(model, tok, make_heads("eagle3", model), tree="chain-4")
    for p in prompts(tok, n=3):
        ref = reference(model, p, 16)
        spec.new_proposer = lambda: OracleProposer(make_proposer(spec.heads), ref, len(p), model.config.vocab_size)
        assert spec.generate(p, max_new_tokens=16).ids == ref


def test_from_pretrained_passes_device_map_and_attention(llama_dir, tmp_path):
    model, _ = load_target(str(llama_dir))
    heads = make_heads("medusa", model)
    heads.save_pretrained(tmp_path / "heads")
    spec = Speculator.from_pretrained(str(llama_dir), tmp_path / "heads", device_map="cpu",
                                      attn_implementation="eager", static_cache=True)
    assert spec.target.config._attn_implementation == "eager" and spec.runtime.static_cache
    assert spec.generate("def f(x):", max_new_tokens=8).stats.new_tokens == 8


def test_device_map_errors(llama_dir):
    with pytest.raises(TargetError, match="not both"):
        load_target(str(llama_dir), device="cpu", device_map="cpu")
    with pytest.raises(TargetError, match="not a JSON object"):
        parse_device_map("{bad")
    assert parse_device_map(' {"": "cpu"}') == {"": "cpu"} and parse_device_map("auto") == "auto"


def test_dtype_auto_is_float32_on_cpu_and_the_model_dtype_on_cuda(llama_dir):
    assert load_dtype("auto", "cpu") == torch.float32
    assert load_dtype("auto", "cuda:0") == "auto"  # from_pretrained then reads the config's dtype
    assert load_dtype("auto", None, {"": "cpu"}) == torch.float32
    assert load_dtype("auto", None, {"model": "cuda:0", "lm_head": "cpu"}) == "auto"
    assert load_dtype("bf16") == torch.bfloat16
    model, _ = load_target(str(llama_dir), dtype="auto", device="cpu")
    assert next(model.parameters()).dtype == torch.float32


def test_cli_configs_take_the_runtime_options():
    from headway.bench.configs import BenchConfig, TuneConfig
    from headway.decode.cli import ChatConfig, GenerateConfig

    for cls in (GenerateConfig, ChatConfig, BenchConfig, TuneConfig):
        assert issubclass(cls, DecodeTargetArgs), cls
    cfg = GenerateConfig(target="demo", heads="h", prompt="x", dtype="auto", device_map="auto",
                         attn_implementation="sdpa", heads_dtype="float32", static_cache=True, compile=False)
    assert cfg.device_map == "auto" and cfg.heads_dtype == "float32"


# -- heads dtype -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["medusa", "eagle1", "eagle3"])
def test_heads_follow_a_bf16_target_and_decode(kind):
    """bf16 target: heads cast to bf16 by default, float32 on request; both decode without error
    and match the bf16 target's own greedy output at a high rate. Not always: a tree forward
    rounds differently from HF's one-token forwards, and bf16 rounding (~1e-2) flips near-ties,
    which the tiny random target has many of (measured here: every prompt matched)."""
    model, tok = tiny_target("llama")
    model = model.to(torch.bfloat16)
    heads = make_heads(kind, model)
    auto = Speculator(model, tok, heads, tree="mc_sim_7b_63")
    assert next(auto.heads.parameters()).dtype == torch.bfloat16
    fp32 = Speculator(model, tok, make_heads(kind, model), tree="mc_sim_7b_63", heads_dtype="float32")
    assert next(fp32.heads.parameters()).dtype == torch.float32
    matched = total = 0
    for p in prompts(tok, n=8):
        ref = reference(model, p, 16)
        for spec in (auto, fp32):
            spec.new_proposer = lambda s=spec: OracleProposer(make_proposer(s.heads), ref, len(p),
                                                              model.config.vocab_size)
            matched += spec.generate(p, max_new_tokens=16).ids == ref
            total += 1
    assert matched >= 0.75 * total, (matched, total)


def test_unknown_heads_dtype(models):
    model, tok = models["llama"]
    with pytest.raises(DecodeError, match="heads dtype"):
        Speculator(model, tok, make_heads("medusa", model), heads_dtype="int8")


# -- static cache ----------------------------------------------------------------------------
def test_tree_mask_pads_a_static_cache():
    visible = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    dyn = tree_mask(visible, 4, torch.float32)
    assert dyn.shape == (1, 1, 3, 7) and (dyn[..., :4] == 0).all() and torch.equal(dyn[0, 0, :, 4:] == 0, visible)
    static = tree_mask(visible, 4, torch.float32, kv_len=10)  # (1, 1, 3, 10)
    assert static.shape == (1, 1, 3, 10) and torch.equal(static[..., :7], dyn)
    assert (static[..., 7:] == torch.finfo(torch.float32).min).all()


def test_keep_accepted_is_the_same_on_static_and_dynamic_caches(models):
    model, _ = models["llama"]
    ids = torch.randint(3, 300, (1, 9))
    caches = [new_cache(model.config), new_cache(model.config, 32)]
    assert isinstance(caches[0], DynamicCache) and isinstance(caches[1], StaticCache)
    assert static_length(caches[0]) is None and static_length(caches[1]) == 32
    for c in caches:
        model(input_ids=ids, **{cache_kwarg(): c}, use_cache=True)  # 5 prefix + 4 "tree" entries
        keep_accepted(c, 5, 4, torch.tensor([0, 2]))
        assert int(c.get_seq_length()) == 7
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(a.keys, b.keys[..., :7, :]) and torch.equal(a.values, b.values[..., :7, :])


def test_keep_accepted_moves_only_paths_off_the_first_slots(models):
    model, _ = models["llama"]
    assert in_place(torch.tensor([0])) and in_place(torch.tensor([0, 1, 2]))
    assert not in_place(torch.tensor([0, 2])) and not in_place(torch.tensor([0, 1, 3]))
    ids = torch.randint(3, 300, (1, 9))
    for nodes in ([0, 1], [0, 3]):
        c = new_cache(model.config)
        model(input_ids=ids, **{cache_kwarg(): c}, use_cache=True)  # 5 prefix + 4 "tree" entries
        before = [(layer.keys.clone(), layer.values.clone()) for layer in c.layers]
        keep_accepted(c, 5, 4, torch.tensor(nodes))
        src = torch.tensor([0, 1, 2, 3, 4] + [5 + n for n in nodes])
        for layer, (k, v) in zip(c.layers, before):
            assert torch.equal(layer.keys, k[..., src, :]) and torch.equal(layer.values, v[..., src, :])


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_static_cache_matches_greedy_generate(models, arch, kind):
    model, tok = models[arch]
    V = model.config.vocab_size
    heads = make_heads(kind, model)
    for shape in ["chain-4", "mc_sim_7b_63", "dynamic-4-4-12"]:
        dyn = Speculator(model, tok, heads, tree=shape)
        static = Speculator(model, tok, heads, tree=shape, static_cache=True)
        for i, p in enumerate(prompts(tok, n=3, seed=7)):
            ref = reference(model, p, 40)
            outs = []
            for spec in (dyn, static):
                spec.new_proposer = lambda s=spec: OracleProposer(make_proposer(s.heads), ref, len(p), V, seed=i)
                outs.append(spec.generate(p, max_new_tokens=40))
            assert outs[0].ids == outs[1].ids == ref, (arch, kind, shape, i)
            assert outs[0].stats.accepted_per_depth == outs[1].stats.accepted_per_depth
            assert outs[1].stats.tau > 1.2  # drafts were accepted: the rollback was exercised


def test_static_cache_needs_max_new_tokens(models):
    model, tok = models["llama"]
    spec = Speculator(model, tok, make_heads("medusa", model), static_cache=True)
    with pytest.raises(DecodeError, match="max_new_tokens"):
        spec.start(torch.tensor([[5, 6, 7, 8, 9]]), SamplingParams(), torch.Generator())
    state = spec.start(torch.tensor([[5, 6, 7, 8, 9]]), SamplingParams(), torch.Generator(), max_new_tokens=10)
    assert static_length(state.kv.cache) == 5 + 10 + spec.tree.size


# -- torch.compile ---------------------------------------------------------------------------
@pytest.mark.slow  # ~50 s per head kind on 2 CPU cores (inductor compiles C++)
@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_compiled_decoder_matches_greedy_generate(kind):
    model, tok = tiny_target("llama")
    spec = Speculator(model, tok, make_heads(kind, model), tree="chain-4", compile=True)
    assert spec.runtime.static_cache and spec.runtime.compiled and spec.kernels.kernel == "stock"  # compile picks its own kernels
    for i, p in enumerate(prompts(tok, n=2)):
        ref = reference(model, p, 12)
        spec.new_proposer = lambda: OracleProposer(make_proposer(spec.heads), ref, len(p), model.config.vocab_size,
                                                   seed=i)
        assert spec.generate(p, max_new_tokens=12).ids == ref


def test_missing_attention_kernel_is_one_line(llama_dir):
    try:
        import flash_attn  # noqa: F401
        pytest.skip("flash-attn is installed here")
    except ImportError:
        pass
    with pytest.raises(TargetError, match="FlashAttention2"):
        load_target(str(llama_dir), attn_implementation="flash_attention_2", device="cpu")
