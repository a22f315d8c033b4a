"""Pushing a checkpoint folder to the Hugging Face Hub (``headway push``).

Every failure that can be known before uploading is reported at once, in one line: a malformed
repo id, offline mode, no token, an unreachable endpoint (one short probe instead of
huggingface_hub's retry loop, which waits ~23 s per file when there is no network). The model
card is written again for the repo (its usage lines name the repo id; ``--license`` is stated) in a
staging copy of the checkpoint: the folder on disk keeps the card it was saved with.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..config import opt
from ..errors import HeadwayError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_LICENSE = re.compile(r"^[a-z0-9][a-z0-9.+-]*$")  # the Hub's license ids: apache-2.0, mit, cc-by-4.0, other, ...
PROBE_TIMEOUT_S = 5.0


class HubError(HeadwayError):
    pass


def check_repo_id(repo_id: str) -> None:
    if not _REPO_ID.match(repo_id) or ".." in repo_id or repo_id.endswith((".git", ".")):
        raise HubError(f"repo id must look like 'org/name' (letters, digits, '-', '_', '.'); got '{repo_id}'")


def check_reachable(endpoint: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """One HEAD request with a short timeout: any HTTP answer means the Hub can be reached."""
    import httpx

    try:
        httpx.head(endpoint, timeout=timeout, follow_redirects=False)
    except httpx.HTTPError as e:
        raise HubError(f"cannot reach {endpoint} ({type(e).__name__}: {str(e) or 'no answer'}); "
                       "check the network, a proxy, or HF_ENDPOINT") from None


def push_folder(folder: Path, repo_id: str, private: bool = False, revision: str | None = None,
                token: str | None = None, endpoint: str | None = None) -> str:
    """create_repo + upload_folder; fails fast (no retries) when offline or without a token."""
    check_repo_id(repo_id)
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise HubError("HF_HUB_OFFLINE is set: cannot push. Unset it and make sure the network is reachable")
    from huggingface_hub import HfApi, constants, get_token

    token = token or get_token()
    if not token:
        raise HubError("no Hugging Face token: run `hf auth login` or set HF_TOKEN before pushing")
    endpoint = endpoint or constants.ENDPOINT
    check_reachable(endpoint)
    api = HfApi(token=token, endpoint=endpoint)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), revision=revision,
                                 commit_message="Upload headway heads")
    except Exception as e:  # network and auth errors come as several exception types
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise HubError(f"push to '{repo_id}' failed: {first}") from None
    return str(getattr(info, "commit_url", repo_id))


def check_license(license: str | None) -> None:
    if license is not None and not _LICENSE.match(license):
        raise HubError(f"license must be a Hub license id such as apache-2.0, mit or other; got '{license}'")


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # the weights can be gigabytes: a hard link costs nothing
    except OSError:
        shutil.copy2(src, dst)


@contextlib.contextmanager
def staged_for_push(folder: Path, repo_id: str, license: str | None = None) -> Iterator[Path]:
    """A copy of the checkpoint whose model card is written again for ``repo_id``: the usage lines
    name the repo instead of the saved card's placeholder, and ``license`` (if given) is stated.
    The checkpoint folder itself is left as it is."""
    from .card import export_card, model_card

    cfg = folder_config(folder)
    try:
        tmp = tempfile.mkdtemp(prefix=f".{folder.name}.push-", dir=folder.parent)  # same disk: links work
    except OSError:
        tmp = tempfile.mkdtemp(prefix="headway-push-")
    try:
        stage = Path(tmp) / folder.name
        shutil.copytree(folder, stage, copy_function=_link_or_copy)
        card = stage / "README.md"
        card.unlink()  # a hard link to the original card: replace it, never write through it
        text = (folder / "README.md").read_text()
        card.write_text(model_card(cfg, repo_id=repo_id, license=license) if "kind" in cfg
                        else export_card(cfg, text, repo_id=repo_id, license=license))
        yield stage
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def folder_config(folder: Path) -> dict:
    """config.json of a native checkpoint (``kind``) or of a ``headway export`` (its ``headway``
    block); any other folder is refused."""
    from ..config import read_json_object
    from .files import read_config

    f = folder / "config.json"
    cfg = read_json_object(f, HubError) if f.is_file() else {}
    exported = cfg.get("headway")
    if isinstance(exported, dict) and "kind" not in cfg and exported.get("format") and exported.get("kind"):
        return cfg
    return read_config(folder)  # a native checkpoint, or the error saying what is missing


def weight_files(folder: Path, cfg: dict) -> list[Path]:
    """The safetensors files to check: model.safetensors for a checkpoint, every *.safetensors of
    an export (TensorRT-LLM's Medusa is medusa_lm_head.safetensors)."""
    if "kind" in cfg:
        return [folder / "model.safetensors"]
    return sorted(folder.glob("*.safetensors")) or [folder / "model.safetensors"]


def check_publishable(cfg: dict, folder: Path) -> None:
    """A speculators export names its verifier (the target) in config.json, and vLLM loads that
    name: a local path there would publish a drafter nobody else can start."""
    from .card import is_absolute_path

    verifier = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or ""
    if "kind" not in cfg and is_absolute_path(verifier):
        raise HubError(f"{folder} is a speculators export whose verifier is the local path {verifier}; vLLM on "
                       "another machine cannot load it. Export heads trained for a Hub target (or edit "
                       "speculators_config.verifier.name_or_path to its repo id) before pushing")


def push_heads(heads: str | Path, repo_id: str, private: bool = False, revision: str | None = None,
               token: str | None = None, endpoint: str | None = None, license: str | None = None) -> str:
    """Push a native heads checkpoint folder (config.json + model.safetensors + README.md) or a
    ``headway export`` folder, its card written again for ``repo_id`` (and ``license``)."""
    check_repo_id(repo_id)
    check_license(license)
    folder = Path(heads).expanduser()
    if not folder.is_dir():
        raise HubError(f"heads folder not found: {heads}")
    from .files import check_finite, read_tensors

    cfg = folder_config(folder)  # a headway checkpoint or export, not any folder
    check_publishable(cfg, folder)
    for f in [*weight_files(folder, cfg), folder / "README.md"]:
        if not f.is_file():
            raise HubError(f"{folder} has no {f.name}; save it with save_pretrained or headway export (which "
                           "write the card)")
    for weights in weight_files(folder, cfg):  # never publish a truncated file or NaN weights
        check_finite(read_tensors(weights, HubError), str(weights), HubError)
    with staged_for_push(folder, repo_id, license) as stage:
        return push_folder(stage, repo_id, private=private, revision=revision, token=token, endpoint=endpoint)


@dataclass
class PushConfig:
    heads: str = opt(help="heads checkpoint folder (config.json + model.safetensors + README.md), or a folder "
                          "written by `headway export`", positional=True)
    repo_id: str = opt(help="Hub repository, org/name (created if missing)", positional=True)
    private: bool = opt(False, "create the repository as private")
    revision: str | None = opt(None, "branch to push to (created if missing); default main")
    license: str | None = opt(None, "license id for the model card (apache-2.0, mit, ...); default: the target's "
                                    "when headway knows it (demo, smollm2), else 'other' with a note to check the "
                                    "target model's license")


def push_cli(cfg: PushConfig) -> int:
    t0 = time.perf_counter()
    url = push_heads(cfg.heads, cfg.repo_id, private=cfg.private, revision=cfg.revision, license=cfg.license)
    print(f"pushed {cfg.heads} to {url} ({time.perf_counter() - t0:.1f}s)")
    return 0
