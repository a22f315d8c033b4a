"""The native checkpoint (design.md §4) through the Hub: model card, loading by repo id from the
Hub cache offline, and `headway push` failing fast (offline, no token, unreachable, bad repo id)."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from huggingface_hub import constants

from headway.cli import main
from headway.heads import Eagle3Drafter, HeadsError, MedusaHeads, load_heads
from headway.heads.hub import HubError, push_folder, push_heads
from headway.testing import tiny_target

TARGET_FIELDS = {"name_or_path", "revision", "hidden_size", "vocab_size", "num_hidden_layers", "architecture"}


@pytest.fixture(scope="module")
def target():
    model, _ = tiny_target("llama", num_hidden_layers=4)
    return model


@pytest.fixture
def medusa(target):
    heads = MedusaHeads.for_target(target, num_heads=2)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.05)
    heads.target_info.name_or_path = "someorg/tiny-llama"
    heads.metadata = {"training": {"data": "runs/distill-demo", "train_rows": 460, "tokens": 88000, "steps": 87},
                      "eval": {"tau": 1.75, "accept_rate_by_depth": [0.41, 0.22], "positions": 1024}}
    return heads


@pytest.fixture
def connections(monkeypatch) -> list:
    """Every socket connection the code under test attempts (its address), made as usual: a test of
    an offline or fail-fast path asserts how many there were instead of timing it."""
    import socket

    made: list = []
    real = socket.socket.connect

    def connect(sock, address):
        made.append(address)
        return real(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    return made


@pytest.fixture
def no_upload(monkeypatch) -> None:
    """A push that builds an ``HfApi`` client has gone past the checks that should have stopped it."""
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise AssertionError("push built an HfApi client: it should have failed before")

    monkeypatch.setattr(huggingface_hub, "HfApi", refuse)


def front_matter(readme: str) -> dict:
    assert readme.startswith("---\n")
    return yaml.safe_load(readme.split("---\n")[1])


def test_native_checkpoint_files_config_and_card(medusa, tmp_path):
    out = medusa.save_pretrained(tmp_path / "heads")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["kind"] == "medusa" and cfg["headway_version"]
    assert {"num_heads", "num_layers", "own_lm_head", "bias", "hidden_size", "vocab_size"} <= set(cfg)
    assert set(cfg["target"]) == TARGET_FIELDS and cfg["target"]["num_hidden_layers"] == 4
    card = (out / "README.md").read_text()
    fm = front_matter(card)
    assert fm == {"library_name": "headway", "license": "other", "tags": ["speculative-decoding", "medusa"],
                  "base_model": "someorg/tiny-llama"}
    assert "## Training data" in card and "| training rows | 460 |" in card
    assert "## Measured acceptance" in card and "**1.750**" in card and "| 2 | 0.220 |" in card


def test_card_leaves_out_base_model_for_a_local_target(target, tmp_path):
    heads = Eagle3Drafter.for_target(target)
    heads.target_info.name_or_path = str(tmp_path / "my-target")
    fm = front_matter((heads.save_pretrained(tmp_path / "h") / "README.md").read_text())
    assert "base_model" not in fm and fm["tags"] == ["speculative-decoding", "eagle3"]
    assert "Measured acceptance" not in (tmp_path / "h" / "README.md").read_text()  # nothing measured yet


def hub_checked(card: str) -> dict:
    """The front matter, read and validated by huggingface_hub's own card classes (offline)."""
    from huggingface_hub import ModelCard, ModelCardData

    fm = front_matter(card)
    parsed = ModelCard(card)  # parses the YAML block as the Hub does
    assert parsed.data.to_dict() == fm
    assert ModelCardData(**fm).to_dict() == fm  # ignore_metadata_errors=False: a bad field raises
    assert "pipeline_tag" not in fm  # heads cannot generate on their own
    return fm


def test_card_front_matter_is_what_the_hub_reads(medusa, tmp_path):
    card = (medusa.save_pretrained(tmp_path / "h") / "README.md").read_text()
    fm = hub_checked(card)
    assert fm["license"] == "other" and "check the target model's license" in card
    assert "THIS_REPO" not in card and 'Speculator.from_pretrained("someorg/tiny-llama", "path/to/these/heads")' in card
    assert "headway export path/to/these/heads --format" in card
    assert "## Measured acceptance" in card and "| 1 | 0.410 |" in card  # the acceptance table stays


@pytest.mark.parametrize("where,label,load_as,license", [
    ("models/my-llama", "my-llama", "path/to/my-llama", "other"),
    ("cache/targets/smollm2-0.1.2", "smollm2-0.1.2", "smollm2", "apache-2.0"),  # a named target: its license
    ("cache/targets/demo-0123abcd", "demo-0123abcd", "demo", "apache-2.0"),  # the demo target is headway's
])
def test_card_names_a_local_target_by_its_folder_never_its_path(medusa, tmp_path, where, label, load_as, license):
    local = tmp_path / where
    medusa.target_info.name_or_path = str(local)
    medusa.metadata["training"] = {"data": str(tmp_path / "runs" / "distill"), "target": str(local),
                                   "features": None, "options": {"dirs": [str(tmp_path / "x" / "y")]}}
    card = (medusa.save_pretrained(tmp_path / "h") / "README.md").read_text()
    fm = hub_checked(card)
    assert str(tmp_path) not in card and "/tmp" not in card and "~/" not in card
    assert card.splitlines()[card.splitlines().index("---", 1) + 2] == f"# Medusa heads for {label}"
    assert f"| name_or_path | {label} |" in card and "| data | distill |" in card
    assert f'Speculator.from_pretrained("{load_as}", "path/to/these/heads")' in card
    assert fm["license"] == license and "base_model" not in fm


def test_push_writes_the_card_again_for_the_repo(medusa, tmp_path, monkeypatch):
    src = medusa.save_pretrained(tmp_path / "h")
    saved = (src / "README.md").read_text()
    pushed = {}

    def fake_push(folder, repo_id, **kw):
        pushed["files"] = sorted(p.name for p in folder.iterdir())
        pushed["card"] = (folder / "README.md").read_text()
        pushed["folder"] = folder
        return f"https://hub/{repo_id}"

    monkeypatch.setattr("headway.heads.hub.push_folder", fake_push)
    assert push_heads(src, "someorg/heads", license="mit") == "https://hub/someorg/heads"
    card = pushed["card"]
    assert pushed["files"] == ["README.md", "config.json", "model.safetensors"]
    assert 'Speculator.from_pretrained("someorg/tiny-llama", "someorg/heads")' in card
    assert "headway export someorg/heads --format" in card and "path/to/these/heads" not in card
    assert hub_checked(card)["license"] == "mit"
    assert (src / "README.md").read_text() == saved  # the local card is left as saved
    assert not pushed["folder"].exists()  # the staging copy is gone
    assert sorted(p.name for p in src.parent.iterdir()) == ["h"]
    assert main(["push", str(src), "someorg/heads"]) == 0
    assert hub_checked(pushed["card"])["license"] == "other"
    with pytest.raises(HubError, match="license must be"):
        push_heads(src, "someorg/heads", license="Not a license")
    assert medusa.push_to_hub("someorg/direct", license="apache-2.0") == "https://hub/someorg/direct"
    assert 'Speculator.from_pretrained("someorg/tiny-llama", "someorg/direct")' in pushed["card"]
    assert hub_checked(pushed["card"])["license"] == "apache-2.0"


def hub_cache_layout(cache: Path, repo_id: str, folder: Path, commit: str = "a" * 40) -> str:
    """What huggingface_hub leaves after a download: refs/main -> commit, snapshots/<commit>/files."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in folder.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    return commit


def test_load_by_repo_id_from_the_hub_cache_offline(medusa, target, tmp_path, monkeypatch, connections):
    cache = tmp_path / "hub"
    commit = hub_cache_layout(cache, "someorg/tiny-medusa", medusa.save_pretrained(tmp_path / "heads"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    loaded = MedusaHeads.from_pretrained("someorg/tiny-medusa", target=target)
    assert connections == []  # no network probing
    x = torch.randn(3, 64)
    torch.testing.assert_close(loaded(x), medusa.attach(target)(x))
    assert loaded.metadata["eval"]["tau"] == 1.75
    assert isinstance(load_heads("someorg/tiny-medusa", revision=commit), MedusaHeads)
    with pytest.raises(HeadsError, match="no such folder 'someorg/absent', and as a Hub repo id it is not in"):
        load_heads("someorg/absent")


def test_export_reads_heads_by_repo_id_from_the_hub_cache(medusa, tmp_path, monkeypatch):
    from headway.heads.export import export_heads

    cache = tmp_path / "hub"
    hub_cache_layout(cache, "someorg/tiny-medusa", medusa.save_pretrained(tmp_path / "heads"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    out = export_heads("someorg/tiny-medusa", "vllm", tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["num_heads"] == 2


# -- push: every failure that can be known before uploading is immediate ---------------------------
def test_push_offline_fails_fast(medusa, tmp_path, monkeypatch, connections, no_upload):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError, match="HF_HUB_OFFLINE is set"):
        push_heads(medusa.save_pretrained(tmp_path / "h"), "someorg/heads", token="hf_fake")
    assert connections == []  # refused before any network call


def no_token(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"))


def test_push_without_token_fails_fast(medusa, tmp_path, monkeypatch, connections, no_upload):
    no_token(monkeypatch, tmp_path)
    with pytest.raises(HubError, match="no Hugging Face token"):
        push_heads(medusa.save_pretrained(tmp_path / "h"), "someorg/heads")
    assert connections == []


def test_push_to_an_unreachable_hub_fails_fast(medusa, tmp_path, monkeypatch, connections, no_upload):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(HubError, match="cannot reach http://127.0.0.1:9"):
        push_folder(medusa.save_pretrained(tmp_path / "h"), "someorg/heads", token="hf_fake",
                    endpoint="http://127.0.0.1:9")  # nothing listens on port 9
    assert connections == [("127.0.0.1", 9)]  # one probe: no retry loop


@pytest.mark.parametrize("repo_id", ["noslash", "a/b/c", "/abs/path", "org/", "-org/name", "org/na me",
                                     "org/../x", "org/name.git"])
def test_push_bad_repo_id_fails_before_anything_else(repo_id, tmp_path):
    with pytest.raises(HubError, match="repo id must look like 'org/name'"):
        push_heads(tmp_path / "does-not-matter", repo_id)


def test_push_refuses_a_folder_that_is_not_a_checkpoint(tmp_path, monkeypatch):
    (tmp_path / "junk").mkdir()
    with pytest.raises(HeadsError, match="no config.json"):
        push_heads(tmp_path / "junk", "someorg/heads")
    with pytest.raises(HubError, match="not found"):
        push_heads(tmp_path / "absent", "someorg/heads")


def test_push_cli_prints_one_line(medusa, tmp_path, monkeypatch, capsys):
    no_token(monkeypatch, tmp_path)
    src = medusa.save_pretrained(tmp_path / "h")
    assert main(["push", str(src), "someorg/heads", "--private"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("headway push: error: no Hugging Face token") and "\n" not in err
    assert main(["push", str(src), "not-a-repo-id"]) == 2
    assert "org/name" in capsys.readouterr().err
