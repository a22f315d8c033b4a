"""Every YAML under configs/ loads through the dataclass of the command it is for (none skipped)."""

from pathlib import Path

import pytest

from headway.cli import _load
from headway.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.y*ml"))

# filename prefix -> "module:ConfigClass"; anything else is a training recipe
PREFIXES = {
    "demo-target": "headway.demo.builder:TargetBuildConfig",
    "distill-": "headway.data.distill:DistillConfig",
    "features-": "headway.data.features:FeaturesConfig",
    "prompts-": "headway.data.self_prompts:PromptsConfig",
}
TRAIN = "headway.train.config:TrainConfig"


def config_class_for(path: Path) -> str:
    for prefix, ref in PREFIXES.items():
        if path.name.startswith(prefix):
            return ref
    return TRAIN


def test_there_are_configs():
    names = {p.name for p in CONFIGS}
    assert {"demo-medusa.yaml", "vicuna-7b-medusa1.yaml", "llama3.1-8b-medusa2.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_loads(path):
    cfg = load_config(_load(config_class_for(path)), path)
    if config_class_for(path) == TRAIN:
        assert cfg.kind and cfg.data, f"{path.name}: a training recipe names its kind and data"


def test_recipes_say_what_they_are():
    from headway.train.config import TrainConfig

    vicuna = load_config(TrainConfig, [p for p in CONFIGS if p.name == "vicuna-7b-medusa1.yaml"][0])
    assert vicuna.kind == "medusa" and vicuna.optim.lr == 1e-3 and vicuna.medusa.num_layers == 1
    llama = load_config(TrainConfig, [p for p in CONFIGS if p.name == "llama3.1-8b-medusa2.yaml"][0])
    assert llama.kind == "medusa2" and llama.optim.head_lr_mult == 4.0 and llama.lora.heads_weight == 0.2
