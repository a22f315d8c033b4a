"""Save / load / push for every head kind: the native checkpoint of design.md §4.

A checkpoint is a folder: ``config.json`` (``headway_version``, ``kind``, every architecture
field, ``target`` info), ``model.safetensors`` and a ``README.md`` model card. Loading is
strict and checks the target in hand against the recorded one.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import save_file
from torch import nn

from .. import __version__
from ..config import ConfigError, from_dict
from ..publish import publishing
from ..target import TargetInfo
from .files import (HeadsError, check_finite, read_config, read_tensors,  # noqa: F401  (re-exported)
                    resolve_checkpoint)

TOKENIZER_KEY = "tokenizer_fingerprint"  # metadata entry: tokenizer_fingerprint() of the training target's tokenizer


class HeadsBase(nn.Module):
    """Common checkpoint behaviour; subclasses set ``kind`` and ``config_class``."""

    kind: ClassVar[str]
    config_class: ClassVar[type]

    def __init__(self, config: Any, target_info: TargetInfo | None = None) -> None:
        super().__init__()
        self.config = config
        self.target_info = target_info
        self.metadata: dict[str, Any] = {}  # training data summary, measured acceptance, ...

    # -- target binding -------------------------------------------------------------------
    def attach(self, target: nn.Module, tokenizer: Any = None) -> "HeadsBase":
        """Bind the frozen target modules the heads borrow (embedding, lm_head), after checking
        the target (and, when given, its tokenizer) matches. Borrowed modules are not submodules:
        never saved, never trained."""
        info = TargetInfo.of(target)
        if self.target_info is not None:
            self.target_info.check_matches(info)
        else:
            self.target_info = info
        self._check_target(target)
        self.check_tokenizer(tokenizer)
        object.__setattr__(self, "_target_embed", target.get_input_embeddings())
        object.__setattr__(self, "_target_lm_head", target.get_output_embeddings())
        return self

    def _check_target(self, target: nn.Module) -> None:
        ours = (self.config.hidden_size, self.config.vocab_size)
        theirs = (int(target.config.hidden_size), int(target.get_output_embeddings().weight.shape[0]))
        for name, a, b in zip(("hidden_size", "vocab_size"), ours, theirs):
            if a != b:
                raise HeadsError(f"{self.kind} heads have {name}={a}, but the target has {name}={b}")

    def record_tokenizer(self, tokenizer: Any) -> None:
        """Store the training target's tokenizer fingerprint in the metadata (checked on load)."""
        from ..tokenizer import tokenizer_fingerprint

        self.metadata[TOKENIZER_KEY] = tokenizer_fingerprint(tokenizer)

    def check_tokenizer(self, tokenizer: Any) -> None:
        """Refuse a tokenizer whose ids mean other tokens than at training time (``check_tokenizer``)."""
        check_tokenizer(self.metadata, tokenizer, f"{self.kind} heads")

    @property
    def target_embed(self) -> nn.Module:
        emb = self.__dict__.get("_target_embed")
        if emb is None:
            raise HeadsError(f"{self.kind} heads are not attached to a target; call .attach(target) first")
        return emb

    @property
    def target_lm_head(self) -> nn.Module:
        head = self.__dict__.get("_target_lm_head")
        if head is None:
            raise HeadsError(f"{self.kind} heads are not attached to a target; call .attach(target) first")
        return head

    # -- serialisation --------------------------------------------------------------------
    def config_dict(self) -> dict[str, Any]:
        return {"headway_version": __version__, "kind": self.kind, **dataclasses.asdict(self.config),
                "target": dataclasses.asdict(self.target_info) if self.target_info else None,
                "metadata": self.metadata}

    # Own save/load, not PyTorchModelHubMixin: the mixin writes in place (no temp + rename), has no NaN refusal,
    # and saves init kwargs, where headway's config.json carries target info, metadata and the draft vocab.
    def save_pretrained(self, path: str | Path, card: bool = True) -> Path:
        """Write the checkpoint atomically: a temp folder beside ``path``, then rename."""
        path = Path(path)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        check_finite(tensors, f"refusing to save {self.kind} heads to {path}")  # a diverged run must not publish
        with publishing(path, folder=True) as tmp:
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "kind": self.kind})
            (tmp / "config.json").write_text(json.dumps(self.config_dict(), indent=2) + "\n")
            if card:
                from .card import model_card

                (tmp / "README.md").write_text(model_card(self.config_dict()))
        return path

    @classmethod
    def _from_config_dict(cls, cfg: dict[str, Any], where: str = "config") -> "HeadsBase":
        fields = {f.name for f in dataclasses.fields(cls.config_class)}
        try:
            config = from_dict(cls.config_class, {k: v for k, v in cfg.items() if k in fields})
        except ConfigError as e:
            raise HeadsError(f"{where}: {e}") from None
        target, metadata = cfg.get("target"), cfg.get("metadata") or {}
        try:
            target = TargetInfo(**target) if target else None
        except TypeError as e:
            raise HeadsError(f"{where}: 'target' must be an object with the fields of TargetInfo ({e})") from None
        if not isinstance(metadata, dict):
            raise HeadsError(f"{where}: 'metadata' must be a JSON object, got {type(metadata).__name__}")
        heads = cls(config, target_info=target)
        heads.metadata = dict(metadata)
        return heads

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, target: nn.Module | None = None,
                        revision: str | None = None, tokenizer: Any = None) -> "HeadsBase":
        """Load a checkpoint of this kind (``heads.load_heads`` loads any kind)."""
        path = resolve_checkpoint(name_or_path, revision)
        return cls.from_folder(path, read_config(path), target, tokenizer)

    @classmethod
    def from_folder(cls, path: Path, cfg: dict[str, Any], target: nn.Module | None = None,
                    tokenizer: Any = None) -> "HeadsBase":
        """The heads of the checkpoint folder ``path`` whose ``config.json`` is ``cfg``; with
        ``target`` given, check it (and ``tokenizer``) and attach."""
        if cfg["kind"] != getattr(cls, "kind", None):
            raise HeadsError(f"{path} holds '{cfg['kind']}' heads, not '{getattr(cls, 'kind', cls.__name__)}'")
        with torch.random.fork_rng(devices=[]):  # the init the weights overwrite must not move a user's seeded RNG
            heads = cls._from_config_dict(cfg, str(path / "config.json"))
        weights = path / "model.safetensors"
        tensors = read_tensors(weights)
        check_finite(tensors, str(weights))
        load_state_strict(heads, tensors, str(weights))
        if target is not None:
            heads.attach(target, tokenizer)
            heads.to(device=next(target.parameters()).device)
        else:
            heads.check_tokenizer(tokenizer)
        return heads.eval()

    def push_to_hub(self, repo_id: str, private: bool = False, revision: str | None = None,
                    token: str | None = None, license: str | None = None) -> str:
        from .card import model_card
        from .hub import check_license, check_repo_id, push_folder

        check_repo_id(repo_id)
        check_license(license)
        with tempfile.TemporaryDirectory() as d:
            folder = self.save_pretrained(Path(d) / "heads")
            # the card for this repo: its usage lines name the repo id, not the saved card's placeholder
            (folder / "README.md").write_text(model_card(self.config_dict(), repo_id=repo_id, license=license))
            return push_folder(folder, repo_id, private=private, revision=revision, token=token)


class DraftVocab:
    """A reduced draft vocabulary on an ``nn.Module``: buffers ``d2t`` (Vd,) int64 (draft id i is
    target id ``i + d2t[i]``) and ``t2d`` (V,) bool (which target ids are in it), EAGLE-3's format.

    Modules without the buffers (``has_draft_vocab`` false) draft over the full target vocabulary:
    draft id == target id. Draft ids are ordered by target id (``set_draft_vocab`` sorts)."""

    def _init_draft_vocab(self, draft_vocab_size: int, vocab_size: int) -> None:
        """Identity draft vocabulary (draft id i is target id i) until ``set_draft_vocab``."""
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))  # (Vd,)
        t2d = torch.zeros(vocab_size, dtype=torch.bool)  # (V,)
        t2d[:draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    @property
    def has_draft_vocab(self) -> bool:
        return "d2t" in self._buffers

    def set_draft_vocab(self, draft_to_target: torch.Tensor) -> None:
        """Use the given target ids (ascending) as the draft vocabulary; fills d2t / t2d."""
        ids = torch.as_tensor(draft_to_target, dtype=torch.long).sort().values.to(self.d2t.device)
        if ids.numel() != self.d2t.numel():
            raise HeadsError(f"draft vocabulary has {ids.numel()} ids, config says {self.d2t.numel()}")
        if ids.unique().numel() != ids.numel() or ids.min() < 0 or ids.max() >= self.t2d.numel():
            raise HeadsError("draft vocabulary ids must be distinct target ids")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_token_ids(self) -> torch.Tensor:
        """(Vd,) the target id of each draft id."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids (any shape) -> target ids (same shape); identity without a draft vocabulary."""
        if not self.has_draft_vocab:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def logit_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids -> indices into what ``logits`` returns in the current mode (-1 outside it)."""
        return self.to_draft_ids(target_ids, missing=-1)

    def to_draft_ids(self, target_ids: torch.Tensor, missing: int = -1) -> torch.Tensor:
        """Target ids (any shape; negative = none) -> draft ids, ``missing`` where the id is not in
        the draft vocabulary (or negative); identity without a draft vocabulary."""
        if not self.has_draft_vocab:
            return target_ids
        lookup = torch.full((self.t2d.numel(),), missing, dtype=torch.long, device=self.d2t.device)  # (V,)
        lookup[self.draft_token_ids()] = torch.arange(self.d2t.numel(), device=self.d2t.device)
        ids = target_ids.to(lookup.device)
        return torch.where(ids >= 0, lookup[ids.clamp(min=0)], torch.full_like(ids, missing))


def check_tokenizer(metadata: dict[str, Any], tokenizer: Any, what: str = "heads") -> None:
    """Refuse a tokenizer whose fingerprint differs from the one in the heads' ``metadata``, naming
    both. Heads saved before fingerprints existed (none recorded), or no tokenizer, pass."""
    recorded = (metadata or {}).get(TOKENIZER_KEY)
    if recorded is None or tokenizer is None:
        return
    from ..tokenizer import tokenizer_fingerprint

    current = tokenizer_fingerprint(tokenizer)
    if current != recorded:
        raise HeadsError(f"{what} were trained with a tokenizer of fingerprint {recorded}, but this target's "
                         f"tokenizer has fingerprint {current}: the same ids mean other tokens; use the target "
                         "(and tokenizer) the heads were trained for")


def load_state_strict(module: nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    own = module.state_dict()
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    if missing or unexpected:
        raise HeadsError(f"{where}: tensors do not match the architecture; missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for k, v in tensors.items():
        if own[k].shape != v.shape:
            raise HeadsError(f"{where}: tensor '{k}' has shape {tuple(v.shape)}, expected {tuple(own[k].shape)}")
    module.load_state_dict(tensors, strict=True)
