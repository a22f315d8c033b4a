"""benchmarks/peers: a headway features folder converted to each peer trainer's input keeps the rows,
loss masks and the same target layers (the aux numbering of each tool), on a tiny target whose
features headway's own code computes. The peers themselves are not installed here."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from headway.data.distill import DistillConfig, distill, load_distilled
from headway.data.features import FeaturesConfig, FeatureStore, features
from headway.target import load_target
from headway.testing import save_tiny_target

HARNESS = Path(__file__).resolve().parents[1] / "benchmarks" / "peers"


def _module(name):
    spec = importlib.util.spec_from_file_location(f"peers_{name}", HARNESS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


convert = _module("convert")
AUX = [1, 2, 3]  # HF hidden-state indices of the tiny target's EAGLE-3 layers
PROMPTS = ["def add(a, b):", "import os\nimport sys", "for i in range(10):", "class A(object):", "while True:"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("peers")
    llama_dir = save_tiny_target(root / "target", "llama", num_hidden_layers=4)  # aux 1 2 3, final after layer 4
    (root / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    path = distill(DistillConfig(source=str(root / "p.jsonl"), output=str(root / "ds"), target=str(llama_dir),
                               max_new_tokens=8, batch_size=5, shard_size=3))
    feats = features(FeaturesConfig(dataset=str(path), output=str(root / "f"), layers=[*map(str, AUX), "final"],
                                    store_dtype="float32", batch_size=2, shard_size=5))
    model, _ = load_target(str(llama_dir))
    return path, load_distilled(path), feats, model


def forward_states(model, ids):
    """HF hidden states of one row (T,) and the post-norm final state, recomputed."""
    with torch.no_grad():
        hs = model(input_ids=ids[None], output_hidden_states=True).hidden_states
    return [h[0] for h in hs]


def test_layer_numbering_per_peer():
    assert convert.peer_layer_ids([2, 15, 27], "speculators") == [2, 15, 27]  # input of layer k
    assert convert.peer_layer_ids([2, 15, 27], "modelopt") == [1, 14, 26]  # output of layer k
    assert convert.peer_layer_ids([2, 15, 27], "specforge") == [1, 14, 26]
    for peer in convert.PEERS:
        assert convert.hf_indices_from_peer(convert.peer_layer_ids([1, 4, 7], peer), peer) == [1, 4, 7]
    with pytest.raises(ValueError, match="embeddings"):
        convert.peer_layer_ids([0, 2, 3], "modelopt")
    with pytest.raises(ValueError, match="unknown peer"):
        convert.peer_layer_ids([1, 2, 3], "eagle")


def test_hf_index_is_output_of_layer_before_and_input_of_layer_k(data):
    """The premise of the numbering: hidden_states[k] = layers[k-1]'s output = layers[k]'s input."""
    _, _, _, model = data
    seen_out, seen_in = {}, {}
    hooks = []
    for k, layer in enumerate(model.model.layers):
        def out_hook(m, a, o, k=k):
            seen_out[k] = o[0] if isinstance(o, tuple) else o

        def in_hook(m, a, kw, k=k):
            seen_in[k] = (a or (kw["hidden_states"],))[0]

        hooks += [layer.register_forward_hook(out_hook), layer.register_forward_pre_hook(in_hook, with_kwargs=True)]
    hs = forward_states(model, torch.tensor([5, 9, 11, 40]))
    for h in hooks:
        h.remove()
    for k in AUX:
        torch.testing.assert_close(hs[k], seen_out[convert.peer_layer_ids([k], "modelopt")[0]][0], rtol=0, atol=0)
        torch.testing.assert_close(hs[k], seen_in[convert.peer_layer_ids([k], "speculators")[0]][0], rtol=0, atol=0)


def test_rows_read_from_features_equal_the_dataset_and_the_target(data):
    _, ds, feats, model = data
    rows = list(convert.read_rows(feats, AUX))
    assert len(rows) == len(ds) == len(PROMPTS)
    for r, d in zip(rows, ds.to_list()):
        assert r.input_ids.tolist() == d["input_ids"] and r.loss_mask.tolist() == d["loss_mask"]
        assert sum(d["loss_mask"]) > 0
        hs = forward_states(model, r.input_ids)
        for got, k in zip(r.aux, AUX):
            torch.testing.assert_close(got, hs[k], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(r.final, hs[-1], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="lacks"):
        list(convert.read_rows(feats, [1, 2, 4]))


def test_speculators_files(data, tmp_path):
    _, ds, feats, model = data
    norm = model.model.norm
    out = convert.write_speculators(list(convert.read_rows(feats, AUX)), tmp_path / "spec", norm.weight.detach(),
                                    model.config.rms_norm_eps)
    from datasets import load_from_disk

    written = load_from_disk(str(out))
    store = FeatureStore(feats)
    assert written.with_format(None)["input_ids"] == ds["input_ids"]
    assert written.with_format(None)["loss_mask"] == ds["loss_mask"]
    assert written.with_format(None)["seq_len"] == [len(x) for x in ds["input_ids"]]
    assert torch.is_tensor(written[0]["input_ids"])  # speculators compares it with torch.equal
    for i, row in enumerate(ds.to_list()):
        t = load_file(str(out / "hidden_states" / f"hs_{i}.safetensors"))
        T = len(row["input_ids"])
        assert t["token_ids"].tolist() == row["input_ids"]
        assert t["hidden_states"].shape == (T, 4, model.config.hidden_size)
        for j, k in enumerate(AUX):
            assert torch.equal(t["hidden_states"][:, j], store[i][f"hidden_states.{k}"])
        # speculators applies the verifier's final norm to slot 3: that gives back headway's final state
        with torch.no_grad():
            torch.testing.assert_close(norm(t["hidden_states"][None, :, 3])[0], store[i]["final"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scale", [1e-2, 1.0, 30.0])  # eps matters (tiny random models) .. negligible
def test_prenorm_equivalent_inverts_the_final_norm(scale):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0)
        x = torch.randn(9, 64) * scale
        final = norm(x)
        x_hat = convert.prenorm_equivalent(final, norm.weight, 1e-5)
        torch.testing.assert_close(norm(x_hat), final, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(norm(final / norm.weight), final, rtol=1e-5, atol=1e-6) or scale > 1e-2
    with pytest.raises(ValueError, match="zero"):
        convert.prenorm_equivalent(torch.ones(2, 3), torch.tensor([1.0, 0.0, 1.0]), 1e-6)


def test_modelopt_and_specforge_files(data, tmp_path):
    _, ds, feats, _ = data
    rows = list(convert.read_rows(feats, AUX))
    mo = convert.write_modelopt(rows, tmp_path / "mo")
    sf = convert.write_specforge(rows, tmp_path / "sf", dtype=torch.float32)
    store = FeatureStore(feats)
    assert len(list(mo.glob("*.pt"))) == len(list(sf.glob("*.ckpt"))) == len(ds)
    for i, row in enumerate(ds.to_list()):
        a = torch.load(mo / f"sample_{i:06d}.pt", weights_only=True)
        b = torch.load(sf / f"data_{i}.ckpt", weights_only=True)
        assert a["input_ids"].tolist() == b["input_ids"].tolist() == row["input_ids"]  # 1-D in both
        assert a["loss_mask"].tolist() == b["loss_mask"].tolist() == row["loss_mask"]
        assert torch.equal(a["hidden_states"], store[i]["final"])
        assert torch.equal(b["hidden_state"][0], store[i]["final"])
        want = torch.cat([store[i][f"hidden_states.{k}"] for k in AUX], dim=-1)  # (T, 3H), low to high
        assert torch.equal(a["aux_hidden_states"], want) and torch.equal(b["aux_hidden_state"][0], want)
        row_bytes = 4 * want.numel() * 4 // 3  # final + 3 aux, float32: not the whole shard a view would drag in
        assert (mo / f"sample_{i:06d}.pt").stat().st_size < 1.5 * row_bytes + 4096


def test_every_peer_gets_the_draft_vocab_headways_trainer_builds(data, tmp_path):
    """The vocabulary files prepare.py hands each peer hold the ids of the drafter ``headway train`` builds
    on the same data (its EAGLE-3 task, not the helper the harness calls): the peers and headway predict
    over the same tokens, and a harness that counted, sorted or offset them otherwise would fail here."""
    import argparse

    import numpy as np

    from headway.config import load_config
    from headway.train.config import TrainConfig
    from headway.train.eagle import Eagle3Task

    path, ds, feats, model = data
    n = 50
    cfg = load_config(TrainConfig, None, {"kind": "eagle3", "target": "tiny", "data": str(path), "output_dir":
                                          str(tmp_path / "hw"), "eagle.draft_vocab_size": n, "eagle.aux_layers": AUX})
    heads = Eagle3Task(cfg).build(model)
    want_d2t, want_t2d = heads.d2t.cpu(), heads.t2d.cpu()  # (n,) int64, (V,) bool
    counts = torch.zeros(model.config.vocab_size, dtype=torch.long)  # counted here, from the answers themselves
    for row in ds.to_list():
        for tok, m in zip(row["input_ids"], row["loss_mask"]):
            counts[tok] += m
    assert int(want_t2d.sum()) == n and counts[want_t2d].sum() == counts.sort(descending=True).values[:n].sum()

    prepare = _module("prepare")
    args = argparse.Namespace(data=str(path), target=str(Path(model.name_or_path)), aux=AUX)
    rows = list(convert.read_rows(feats, AUX))
    got = {}
    for peer in convert.PEERS:
        vocab = prepare.write_peer(peer, rows, tmp_path / "peers", args, [n])["vocab"][str(n)]
        if peer == "speculators":
            got[peer] = torch.from_numpy(np.load(vocab["d2t"])), torch.from_numpy(np.load(vocab["t2d"]))
        elif peer == "modelopt":  # ModelOpt reads d2t only; t2d follows from it
            d2t = torch.load(vocab["d2t"], weights_only=True)
            t2d = torch.zeros_like(want_t2d)
            t2d[torch.arange(d2t.numel()) + d2t] = True
            got[peer] = d2t, t2d
        else:
            m = torch.load(vocab["mapping"], weights_only=True)
            got[peer] = m["d2t"], m["t2d"]
    for peer, (d2t, t2d) in got.items():
        assert torch.equal(d2t.long(), want_d2t), peer
        assert torch.equal(t2d.bool(), want_t2d), peer


def test_vocab_npy(tmp_path):
    import numpy as np

    d2t, t2d = torch.tensor([0, 2, 5]), torch.zeros(10, dtype=torch.bool)
    t2d[[0, 3, 7]] = True
    a, b = convert.write_vocab_npy(d2t, t2d, tmp_path)
    assert a.name == "d2t-3.npy" and np.load(a).tolist() == [0, 2, 5] and np.load(b).dtype == np.bool_


def test_preparing_more_peers_keeps_the_earlier_ones_with_their_lr():
    """A second prepare.py run into the same folder (other peers, same rows) keeps the first run's peers,
    their settings and their LR (the sweep reads each peer's LR from the plan); other rows start afresh."""
    prepare = _module("prepare")
    base = {"features": "f", "rows": 4, "tokens": 40, "draft_vocab_size": 8, "aux_hf_index": [1, 2, 3], "epochs": 2}
    old = {**base, "lr": {"headway": 2e-3, "speculators": 4e-3}, "peers": {"speculators": {"data": "s"}},
           "settings": {"own": {"speculators": {"e": 20}}, "shared": {"speculators": {"e": 2}}}}
    new = {**base, "lr": {"headway": 2e-3, "modelopt": 1e-4}, "peers": {"modelopt": {"data": "m"}},
           "settings": {"own": {"modelopt": {"e": 1}}, "shared": {"modelopt": {"e": 2}}}}
    got = prepare.merge_plans(old, new)
    assert got["lr"] == {"headway": 2e-3, "speculators": 4e-3, "modelopt": 1e-4}
    assert got["peers"] == {"speculators": {"data": "s"}, "modelopt": {"data": "m"}}
    assert got["settings"]["own"] == {"speculators": {"e": 20}, "modelopt": {"e": 1}}
    assert got["settings"]["shared"] == {"speculators": {"e": 2}, "modelopt": {"e": 2}}
    assert prepare.merge_plans({**old, "rows": 5}, new) == new
