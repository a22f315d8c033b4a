"""The settings of ``headway import`` and ``headway export``.

They live here, apart from the code that runs them (``importers``, ``export``; both re-export them),
so that ``headway import --help`` and ``headway export --help`` read them without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import opt

EXPORT_FORMATS = ("vllm", "sglang", "trtllm", "speculators")
EXPORT_DTYPES = ("float32", "bfloat16", "float16")
IMPORT_FORMATS = ("medusa", "eagle", "dflash", "peagle")  # the keys of importers.IMPORTERS


@dataclass
class ImportConfig:
    source: str = opt(help="reference checkpoint: a folder, a file, or a Hub repo id", positional=True)
    out: str = opt(help="write the native heads checkpoint here: a new folder, or one holding only an earlier heads "
                        "checkpoint of the same kind (replaced atomically); never the source or a folder around it")
    target: str | None = opt(None, "target to check the heads against (and record in the checkpoint); "
                                   "'demo' = the demo target")
    format: str = opt("auto", "reference format: auto (from the files), medusa (FasterDecoding or vLLM "
                              "Medusa), eagle (EAGLE-1/EAGLE-3 layouts, speculators), dflash (the published DFlash "
                              "layout or speculators' dflash / dspark), peagle (vLLM's P-EAGLE layout or "
                              "speculators'); reads every `headway export` format",
                      choices=("auto", *IMPORT_FORMATS))


@dataclass
class ExportConfig:
    heads: str = opt(help="headway heads: a checkpoint folder or a Hub repo id (org/name)", positional=True)
    format: str = opt(help="engine format: vllm (Medusa, EAGLE-1, EAGLE-3, P-EAGLE, DFlash: its published layout, "
                           "which SGLang reads too), sglang (EAGLE-1, EAGLE-3), trtllm (Medusa, EAGLE-3), speculators "
                           "(EAGLE-3, P-EAGLE, DFlash, DSpark; vLLM loads it by itself)",
                      choices=EXPORT_FORMATS)
    out: str = opt(help="write the engine folder here: a new folder, or one holding only an earlier headway export to "
                        "this format (replaced atomically); never the heads' folder or a folder around it")
    target: str | None = opt(None, "target model (folder, Hub id or 'demo'); needed only for Medusa heads that "
                                   "share the target's lm_head")
    dtype: str | None = opt(None, "cast floating tensors to float32 | bfloat16 | float16 (default: keep)",
                            choices=EXPORT_DTYPES)
    revision: str | None = opt(None, "Hub revision of the heads")
