"""Pushing a checkpoint folder to the Hugging Face Hub."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import HeadwayError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class HubError(HeadwayError):
    pass


def push_folder(folder: Path, repo_id: str, private: bool = False, revision: str | None = None,
                token: str | None = None) -> str:
    """create_repo + upload_folder; fails fast (no retries) when offline or without a token."""
    if not _REPO_ID.match(repo_id):
        raise HubError(f"repo id must look like 'org/name'; got '{repo_id}'")
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise HubError("HF_HUB_OFFLINE is set: cannot push. Unset it and make sure the network is reachable")
    from huggingface_hub import HfApi, get_token

    token = token or get_token()
    if not token:
        raise HubError("no Hugging Face token: run `hf auth login` or set HF_TOKEN before pushing")
    api = HfApi(token=token)
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
