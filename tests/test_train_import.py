"""Importing FasterDecoding Medusa checkpoints: synthetic reference tensors, both file formats."""

import pytest
import torch
from safetensors.torch import save_file

from headway.heads import HeadsError, MedusaHeads, load_heads
from headway.heads.importers import IMPORTERS, detect_format, import_heads, import_medusa

from train_utils import run_cli


def reference_state(K: int, n: int, H: int, V: int, prefix: str = "", seed: int = 0) -> dict[str, torch.Tensor]:
    """What FasterDecoding's ``medusa_head`` (ModuleList of Sequential(ResBlock*n, Linear)) saves."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for h in range(K):
        for l in range(n):
            sd[f"{prefix}{h}.{l}.linear.weight"] = torch.randn(H, H, generator=g)
            sd[f"{prefix}{h}.{l}.linear.bias"] = torch.randn(H, generator=g)
        sd[f"{prefix}{h}.{n}.weight"] = torch.randn(V, H, generator=g)
    return sd


def reference_forward(sd: dict[str, torch.Tensor], K: int, n: int, x: torch.Tensor, prefix: str = "") -> torch.Tensor:
    out = []
    for h in range(K):
        y = x
        for l in range(n):
            y = y + torch.nn.functional.silu(y @ sd[f"{prefix}{h}.{l}.linear.weight"].T + sd[f"{prefix}{h}.{l}.linear.bias"])
        out.append(y @ sd[f"{prefix}{h}.{n}.weight"].T)
    return torch.stack(out)


@pytest.mark.parametrize("fmt,prefix,K,n", [("pt", "", 4, 1), ("safetensors", "medusa_head.", 3, 2),
                                            ("pt", "medusa_head.", 2, 0)])
def test_import_round_trip(tiny_llama, tmp_path, fmt, prefix, K, n):
    target, _ = tiny_llama
    H, V = 64, target.get_output_embeddings().weight.shape[0]
    sd = reference_state(K, n, H, V, prefix)
    f = tmp_path / f"medusa_lm_head.{fmt}"
    torch.save(sd, f) if fmt == "pt" else save_file(sd, str(f))
    (tmp_path / "config.json").write_text('{"medusa_num_heads": 99, "medusa_num_layers": 7}')  # wrong on purpose

    heads = import_medusa(tmp_path, target)  # the folder; head and layer counts come from the tensor names
    assert isinstance(heads, MedusaHeads)
    assert (heads.config.num_heads, heads.config.num_layers) == (K, n)
    x = torch.randn(2, 5, H)
    torch.testing.assert_close(heads(x), reference_forward(sd, K, n, x, prefix), rtol=1e-5, atol=1e-4)

    out = heads.save_pretrained(tmp_path / "native")
    again = load_heads(out, target=target)
    torch.testing.assert_close(again(x), heads(x))
    assert again.metadata["imported"]["format"] == "fasterdecoding-medusa"
    assert detect_format(tmp_path) == "medusa" and import_heads(f, target).config.num_heads == K


def test_import_refuses_other_target_and_pickles(tiny_llama, tmp_path):
    target, _ = tiny_llama
    V = target.get_output_embeddings().weight.shape[0]
    save_file(reference_state(2, 1, 48, V), str(tmp_path / "medusa_lm_head.safetensors"))
    with pytest.raises(HeadsError, match=r"hidden_size=48.*hidden_size=64"):
        import_medusa(tmp_path, target)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"0.0.weight": torch.zeros(V, 64), "x": Evil()}, tmp_path / "bad.pt")
    with pytest.raises(HeadsError, match="weights_only"):
        import_medusa(tmp_path / "bad.pt", target)
    torch.save({"0.1.weight": torch.zeros(V, 64)}, tmp_path / "gap.pt")
    with pytest.raises(HeadsError, match="ResBlocks 0..0"):
        import_medusa(tmp_path / "gap.pt", target)
    assert set(IMPORTERS) >= {"medusa", "eagle"}


def test_import_cli(llama_dir, tmp_path):
    sd = reference_state(3, 1, 64, 384)
    (tmp_path / "ref").mkdir()  # the output may not be inside the source folder (#63)
    torch.save(sd, tmp_path / "ref" / "medusa_lm_head.pt")
    r = run_cli(["import", str(tmp_path / "ref"), "--out", str(tmp_path / "out"), "--target", str(llama_dir)],
                tmp_path)
    assert r.returncode == 0, r.stderr
    assert load_heads(tmp_path / "out").config.num_heads == 3
