"""headway.data — prompts in; self-distilled datasets, loss masks, target features out.

Modules, one concern each:

- ``samples``: the normalised ``Sample`` form and ``normalize_row`` (pure);
- ``source_spec``: ``SourceSpec``, what a prompt source is (Hub config / split / files, columns, shuffle,
  sample, weight, streaming, presets) and ``parse_sources`` for the forms users write;
- ``sources``: ``read_samples(source)`` for JSONL / JSON / parquet / datasets folders / Hub names / ``demo:``
  / ``chat:`` and specs, mixes included;
- ``chat_corpus``: the built-in chat prompts, read from the checksummed file in ``corpora/``;
- ``chat``: chat templates: conversation pieces for generation, assistant-token masks;
- ``plans``: what the target is asked per sample, within a token budget;
- ``generation``: batched left-padded generation (greedy or sampled);
- ``shards``: global shard plans, atomic writes, resume-settings checks;
- ``distill``: ``headway distill`` and ``load_distilled``;
- ``encode``: ``headway tokenize`` (answers given, no generation);
- ``features``: ``headway features``, ``target_features`` (online == offline) and ``FeatureStore``;
- ``vocab``: token frequencies and the EAGLE-3 draft vocabulary;

The command functions live in their modules (``headway.data.distill.distill``,
``headway.data.features.features``): re-exporting them here would shadow the modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

if TYPE_CHECKING:
    from .distill import DistillConfig, load_distilled
    from .encode import TokenizeConfig, tokenize_dataset, tokenize_sample
    from .errors import BadRowError, ChatTemplateError, DataError, ResumeMismatchError
    from .features import FeaturesConfig, FeatureStore, target_features
    from .samples import Sample
    from .source_spec import SourceSpec, parse_sources
    from .sources import read_samples
    from .vocab import draft_vocab, load_token_counts, token_frequencies

_EXPORTS = {"DistillConfig": "distill", "load_distilled": "distill", "TokenizeConfig": "encode",
            "tokenize_dataset": "encode", "tokenize_sample": "encode", "BadRowError": "errors",
            "ChatTemplateError": "errors", "DataError": "errors", "ResumeMismatchError": "errors",
            "FeaturesConfig": "features", "FeatureStore": "features", "target_features": "features",
            "Sample": "samples", "SourceSpec": "source_spec", "parse_sources": "source_spec", "read_samples": "sources",
            "draft_vocab": "vocab", "load_token_counts": "vocab", "token_frequencies": "vocab"}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
