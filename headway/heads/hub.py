"""Pushing a checkpoint folder to the Hugging Face Hub (``headway push``).

Every failure that can be known before uploading is reported at once, in one line: a malformed
repo id, offline mode, no token, an unreachable endpoint (one short probe instead of
huggingface_hub's retry loop, which waits ~23 s per file when there is no network).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import opt
from ..errors import HeadwayError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
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


def push_heads(heads: str | Path, repo_id: str, private: bool = False, revision: str | None = None,
               token: str | None = None, endpoint: str | None = None) -> str:
    """Push a native heads checkpoint folder (config.json + model.safetensors + README.md)."""
    check_repo_id(repo_id)
    folder = Path(heads).expanduser()
    if not folder.is_dir():
        raise HubError(f"heads folder not found: {folder}")
    from .base import check_finite, read_config, read_tensors

    read_config(folder)  # a headway checkpoint, not any folder
    for name in ("model.safetensors", "README.md"):
        if not (folder / name).is_file():
            raise HubError(f"{folder} has no {name}; save it with save_pretrained (which writes the model card)")
    weights = folder / "model.safetensors"  # never publish a truncated file or NaN weights
    check_finite(read_tensors(weights, HubError), str(weights), HubError)
    return push_folder(folder, repo_id, private=private, revision=revision, token=token, endpoint=endpoint)


@dataclass
class PushConfig:
    heads: str = opt(help="heads checkpoint folder (config.json + model.safetensors + README.md)", positional=True)
    repo_id: str = opt(help="Hub repository, org/name (created if missing)", positional=True)
    private: bool = opt(False, "create the repository as private")
    revision: str | None = opt(None, "branch to push to (created if missing); default main")


def push_cli(cfg: PushConfig) -> int:
    t0 = time.perf_counter()
    url = push_heads(cfg.heads, cfg.repo_id, private=cfg.private, revision=cfg.revision)
    print(f"pushed {cfg.heads} to {url} ({time.perf_counter() - t0:.1f}s)")
    return 0
