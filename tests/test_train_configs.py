"""Every YAML under configs/<model>/ loads through the dataclass of the command it is for (none skipped).

configs/accelerate/ holds accelerate's own configs (tests/test_train_sharded.py loads them)."""

from pathlib import Path

import pytest

from headway.cli import _load
from headway.config import load_config

ROOT = Path(__file__).resolve().parents[1] / "configs"
CONFIGS = sorted(p for p in ROOT.glob("*/*.y*ml") if p.parent.name != "accelerate")

# file name's first word (distill-more.yaml -> distill) -> "module:ConfigClass"; anything else is a training recipe
PREFIXES = {
    "target": "headway.demo.builder:TargetBuildConfig",
    "distill": "headway.data.distill:DistillConfig",
    "features": "headway.data.features:FeaturesConfig",
    "prompts": "headway.data.self_prompts:PromptsConfig",
    "adapt": "headway.adapt.configs:AdaptConfig",
}
TRAIN = "headway.train.config:TrainConfig"


def name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def config_class_for(path: Path) -> str:
    return PREFIXES.get(path.stem.split("-")[0], TRAIN)


def test_there_are_configs():
    names = {name(p) for p in CONFIGS}
    assert {"demo/medusa.yaml", "vicuna-7b/medusa1.yaml", "llama3.1-8b/medusa2.yaml", "llama3.1-8b/distill.yaml"} <= names


def test_configs_are_grouped_by_model():
    """No recipe is left loose at the top: a user finds a model's recipes in its folder."""
    assert not list(ROOT.glob("*.y*ml")), "recipes belong in configs/<model>/"


@pytest.mark.parametrize("path", CONFIGS, ids=[name(p) for p in CONFIGS])
def test_config_loads(path):
    cfg = load_config(_load(config_class_for(path)), path)
    if config_class_for(path) == TRAIN:
        assert cfg.kind and cfg.data, f"{name(path)}: a training recipe names its kind and data"


@pytest.mark.parametrize("path", CONFIGS, ids=[name(p) for p in CONFIGS])
def test_every_recipe_states_its_expected_cost(path):
    header = [line for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("#")]
    assert any("Expected cost:" in line for line in header), f"{name(path)}: no '# Expected cost:' line"


def test_recipes_say_what_they_are():
    from headway.train.config import TrainConfig

    vicuna = load_config(TrainConfig, [p for p in CONFIGS if name(p) == "vicuna-7b/medusa1.yaml"][0])
    assert vicuna.kind == "medusa" and vicuna.optim.lr == 1e-3 and vicuna.medusa.num_layers == 1
    llama = load_config(TrainConfig, [p for p in CONFIGS if name(p) == "llama3.1-8b/medusa2.yaml"][0])
    assert llama.kind == "medusa2" and llama.optim.head_lr_mult == 4.0 and llama.lora.heads_weight == 0.2
