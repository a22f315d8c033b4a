"""headway adapt's settings: the modes the command refuses, the training settings a round derives
from the served heads, the held-out split, and what makes two rounds the same."""

import json

import pytest

from headway.adapt.configs import AdaptConfig
from headway.adapt.errors import AdaptError
from headway.adapt.prompts import split
from headway.adapt.state import round_settings
from headway.adapt.training import base_settings, train_config
from headway.config import ConfigError, load_config


def cfg(**kw):
    base = {"target": "t", "heads": "h", "prompts": "chat:extra", "out": "served"}
    return load_config(AdaptConfig, None, {**base, **kw})


@pytest.mark.parametrize("kw,message", [
    ({"out": None}, "--out is required"),
    ({"prompts": None}, "--prompts is required"),
    ({"heads": None}, "--heads is required"),
    ({"watch": "logs"}, "--watch reads its prompts from the log folder"),
    ({"once": True}, "--once belongs to --watch"),
    ({"prompts": "traffic:"}, "traffic:PATH needs the path"),
    ({"prompts": {"path": "chat:extra", "colums": {}}}, "colums"),
    ({"threshold": -0.1}, "'threshold' must be a finite number >= 0"),
    ({"gate.heldout_fraction": 0.0}, "gate.heldout_fraction' must be > 0"),
    ({"rollback": 2, "prompts": "chat:extra"}, "takes neither --prompts nor --watch"),
    ({"stop_after": "trian"}, "'stop_after' must be one of prompts, before, distill, train, after"),
])
def test_settings_that_cannot_run_are_refused_at_parse_time(kw, message):
    with pytest.raises(ConfigError, match=message):
        cfg(**kw)


def test_each_mode_needs_only_its_own_settings():
    assert cfg().source_kind() == "source"
    assert cfg(prompts="self").source_kind() == "self"
    traffic = cfg(prompts="traffic:logs/")
    assert traffic.source_kind() == "traffic" and traffic.traffic_path() == "logs/"
    watch = load_config(AdaptConfig, None, {"target": "t", "watch": "logs", "out": "served", "once": True})
    assert watch.source_kind() == "traffic" and watch.traffic_path() == "logs"
    rollback = load_config(AdaptConfig, None, {"out": "served", "rollback": 3})  # no target: it copies a folder
    assert rollback.rollback == 3


EAGLE3 = {"kind": "eagle3", "hidden_size": 64, "vocab_size": 384, "draft_vocab_size": 128, "aux_layers": [0, 1, 2],
          "norm_output": True, "norm_before_fc": False, "norm_before_residual": False}
RECORD = {"kind": "eagle3", "options": {"eagle": {"ttt_steps": 3, "hard_weight": 1.0, "draft_vocab_size": 64,
                                                  "aux_layers": [], "init_layer": 1, "norm_output": False}},
          "optim": {"name": "adamw", "lr": 0.002, "warmup_steps": 20}, "seed": 5}


def test_the_architecture_comes_from_the_heads_and_the_loss_from_their_training_record():
    got = base_settings(EAGLE3, {"training": RECORD}, None)
    assert got["kind"] == "eagle3" and got["seed"] == 5 and got["optim"]["lr"] == 0.002
    eagle = got["eagle"]
    assert eagle["draft_vocab_size"] == 128 and eagle["aux_layers"] == [0, 1, 2] and eagle["norm_output"] is True
    assert eagle["ttt_steps"] == 3 and eagle["hard_weight"] == 1.0 and eagle["init_layer"] is None


def test_heads_without_a_record_train_with_the_section_defaults_around_their_architecture():
    got = base_settings({"kind": "medusa", "hidden_size": 64, "vocab_size": 384, "num_heads": 3, "num_layers": 2,
                         "own_lm_head": True, "bias": True, "draft_vocab_size": None}, {}, None)
    assert got == {"kind": "medusa", "medusa": {"num_heads": 3, "num_layers": 2, "own_lm_head": True,
                                                "draft_vocab_size": None}}


def test_a_recipe_replaces_the_record_but_not_the_round_or_the_architecture(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("kind: eagle3\ndata: elsewhere\noutput_dir: elsewhere\neagle:\n  ttt_steps: 5\n"
                      "  draft_vocab_size: 32\noptim:\n  lr: 0.01\n")
    got = base_settings(EAGLE3, {"training": RECORD}, str(recipe))
    assert "data" not in got and "output_dir" not in got
    assert got["eagle"]["ttt_steps"] == 5 and got["eagle"]["draft_vocab_size"] == 128 and got["optim"]["lr"] == 0.01


@pytest.mark.parametrize("config,meta,message", [
    ({"kind": "medusa"}, {"adapter": {"subfolder": "adapter"}}, "Medusa-2"),
    ({"kind": "medusa"}, {"training": {"kind": "medusa2"}}, "cannot adapt 'medusa2' heads"),
    ({"kind": "eagle1"}, {"training": {"kind": "eagle3"}}, "kind 'eagle3', but the heads are 'eagle1'"),
])
def test_heads_adapt_cannot_continue_are_refused(config, meta, message):
    with pytest.raises(AdaptError, match=message):
        base_settings(config, meta, None)


def test_the_rounds_own_settings_go_on_top(tmp_path):
    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "config.json").write_text(json.dumps({**EAGLE3, "metadata": {"training": RECORD}}))
    c = cfg(target="tiny", **{"train.max_steps": 7, "train.lr": 1e-4, "train.batch_size": 3})
    tc = train_config(c, heads, tmp_path / "d", None, tmp_path / "run")
    assert (tc.kind, tc.max_steps, tc.batch_size, tc.optim.lr, tc.optim.warmup_steps) == ("eagle3", 7, 3, 1e-4, 0)
    assert tc.init_from == str(heads) and tc.resume_from == "latest" and tc.data == str(tmp_path / "d")
    assert tc.eagle.draft_vocab_size == 128 and tc.eagle.init_layer is None and tc.target == "tiny"
    assert train_config(cfg(target="tiny"), heads, tmp_path / "d", None, tmp_path / "run").optim.lr == 0.002


def test_the_held_out_split_is_seeded_disjoint_and_never_empty():
    rows = [{"id": str(i), "prompt": f"p{i}"} for i in range(50)]
    train, held = split(rows, 0.1, 64, seed=0)
    assert len(held) == 5 and len(train) == 45 and not {r["id"] for r in train} & {r["id"] for r in held}
    assert split(rows, 0.1, 64, seed=0) == (train, held)
    assert split(rows, 0.1, 64, seed=1)[1] != held
    assert len(split(rows, 0.5, 4, seed=0)[1]) == 4  # at most heldout_max
    assert [len(x) for x in split(rows[:2], 0.01, 64, seed=0)] == [1, 1]  # at least one each
    with pytest.raises(AdaptError, match="at least 2 prompts"):
        split(rows[:1], 0.1, 64, seed=0)


def test_a_rounds_settings_leave_out_how_it_is_driven_and_the_gates_bar(tmp_path):
    a = round_settings(cfg(), tmp_path / "h")
    assert a == round_settings(cfg(threshold=0.5, out="elsewhere", stop_after="train",
                                   **{"train.stop_after": 3, "traffic.min_new_prompts": 9}), tmp_path / "h")
    assert a != round_settings(cfg(**{"distill.max_new_tokens": 9}), tmp_path / "h")
    assert a != round_settings(cfg(), tmp_path / "other")
    assert a["base"] == str((tmp_path / "h").resolve())
