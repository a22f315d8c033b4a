"""Head kinds as contracts (headway/train/contracts.py): every kind has its task, sections and
checks; every option a task reads is in the run fingerprint, so a resumed run with other settings is
refused; the target's limits on the options are refused before anything is written; fused layers
are strictly increasing."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from headway.config import ConfigError, load_config, to_dict
from headway.heads import load_heads
from headway.target import load_target
from headway.testing import save_tiny_target
from headway.train.batch import collate, target_batch
from headway.train.checkpoints import RUN_FILE, run_difference, run_fingerprint
from headway.train.config import TrainConfig
from headway.train.contracts import CONTRACTS, KINDS
from headway.train.errors import TrainError
from headway.train.recipe import train
from headway.train.registry import TASKS

from train_utils import distilled_rows, save_rows

pytestmark = pytest.mark.usefixtures("one_thread")

SECTIONS = {f.name for f in dataclasses.fields(TrainConfig) if dataclasses.is_dataclass(f.default_factory)}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("contracts")
    target = save_tiny_target(root / "target", num_hidden_layers=4)
    data = save_rows(root / "data", distilled_rows(24, 380, seed=0))
    return root, target, data


def config(setup, out: Path, kind: str, **kw) -> TrainConfig:
    _, target, data = setup
    base = {"kind": kind, "target": str(target), "data": str(data), "output_dir": str(out), "batch_size": 4,
            "max_steps": 2, "log_every": 1, "save_every": 0, "eval_fraction": 0.25, "progress": False,
            "medusa.num_heads": 2, "eagle.ttt_steps": 2, "dflash.block_size": 4, "dflash.anchors": 4}
    return load_config(TrainConfig, None, {**base, **kw})


# -- every kind is whole -------------------------------------------------------------------------
def test_every_kind_has_a_task_and_its_sections():
    assert set(KINDS) == set(CONTRACTS) == set(TASKS)
    claimed = {s for c in CONTRACTS.values() for s in c.sections}
    assert claimed <= SECTIONS
    assert SECTIONS - claimed == {"optim"}  # the one section every kind reads, fingerprinted for all
    for kind, contract in CONTRACTS.items():
        assert TASKS[kind].kind == kind == contract.kind


@pytest.mark.parametrize("kind", KINDS)
def test_every_option_of_a_kind_changes_its_fingerprint(kind):
    """Each field of each section the kind reads, set to another valid value, is a refused resume."""
    cfg = load_config(TrainConfig, None, {"kind": kind, "target": "t", "data": "d"})
    before = run_fingerprint(cfg)
    for section in CONTRACTS[kind].sections:
        for f in dataclasses.fields(getattr(cfg, section)):
            value = getattr(getattr(cfg, section), f.name)
            other = {bool: lambda v: not v, int: lambda v: v + 1, float: lambda v: v * 0.5 + 0.125,
                     str: lambda v: v, list: lambda v: [*v, 99], type(None): lambda v: 1}[type(value)](value)
            if other == value:
                continue  # a choice: the other choices are covered by the section compare below
            changed = dataclasses.replace(getattr(cfg, section))
            object.__setattr__(changed, f.name, other)
            now = {**before, section: to_dict(changed)}
            assert run_difference(before, now) == f"'{section}.{f.name}' was {value!r}, now {other!r}", f.name


class Recording:
    """A TrainConfig that records which of its top-level settings are read."""

    def __init__(self, cfg: TrainConfig) -> None:
        object.__setattr__(self, "_cfg", cfg)
        object.__setattr__(self, "read", set())

    def __getattr__(self, name: str):
        self.read.add(name)
        return getattr(self._cfg, name)


@pytest.mark.parametrize("kind", KINDS)
def test_what_a_task_reads_of_the_config_is_in_the_fingerprint(setup, kind):
    """Build, train and evaluate one batch through a recording config: every setting the task read
    is one a resumed run must keep. A new option section a kind forgot to declare fails here."""
    cfg = config(setup, Path("unused"), kind, **({"medusa.kl_weight": 0.1} if kind == "medusa" else {}))
    target, _ = load_target(cfg.target, device="cpu")
    rec = Recording(cfg)
    task = TASKS[kind](rec)
    heads = task.build(target)
    model = task.adapt_target(target)
    batch = collate(distilled_rows(2, 380, seed=3))
    tb = target_batch(model, batch, task.feature_layers(heads), task.needs_logits(), need_ref=model is not target,
                      grad=model is not target)
    loss, _ = task.loss(heads, tb, 0)
    loss.backward()
    with torch.no_grad():
        task.summarize(task.eval_stats(heads, tb))
    task.param_groups(heads, model)
    assert rec.read, "the task read nothing of its config"
    assert rec.read <= set(run_fingerprint(cfg)), rec.read - set(run_fingerprint(cfg))


# -- resuming with other options is refused, old run.json files still resume --------------------
def test_a_dflash_run_resumed_with_other_dflash_options_is_refused(setup, tmp_path):
    out = tmp_path / "run"
    train(config(setup, out, "dflash", max_steps=4, stop_after=2))
    for key, value in (("dflash.block_size", 6), ("dflash.gamma", 0.5), ("dflash.draft_vocab_size", 64),
                       ("dflash.num_layers", 2)):
        with pytest.raises(TrainError, match=f"'{key}' was .*, now {value}"):
            train(config(setup, out, "dflash", max_steps=4, resume_from="latest", **{key: value}))
    final = train(config(setup, out, "dflash", max_steps=4, resume_from="latest"))
    with pytest.raises(TrainError, match="holds another run .*'dflash.gamma' was 4.0, now 0.5"):
        train(config(setup, out, "dflash", max_steps=4, resume_from="latest", **{"dflash.gamma": 0.5}))
    assert load_heads(final).config.block_size == 4


def test_an_old_run_file_without_a_section_or_a_newer_option_still_resumes(setup, tmp_path):
    out = tmp_path / "run"
    train(config(setup, out, "dflash", max_steps=4, stop_after=2))
    run_file = out / RUN_FILE
    old = json.loads(run_file.read_text())
    del old["run"]["dflash"]  # written before DFlash options were fingerprinted
    run_file.write_text(json.dumps(old))
    state = next((out / "checkpoints").glob("checkpoint-2")) / "trainer_state.json"
    saved = json.loads(state.read_text())
    del saved["run"]["dflash"]
    del saved["run"]["optim"]["muon_momentum"]  # an option added since: the run trained with its default
    state.write_text(json.dumps(saved))
    assert train(config(setup, out, "dflash", max_steps=4, resume_from="latest")).name == "final"
    assert run_difference({"optim": {"lr": 1.0}}, {"optim": {"lr": 1.0, "muon_momentum": 0.5}}) == \
        "'optim.muon_momentum' was 0.95, now 0.5"


# -- the target's limits, before anything is written ---------------------------------------------
LIMITS = [
    ("eagle3", {"eagle.aux_layers": [1, 2, 9]}, "reads hidden state 9, but the target has 4 layers"),
    ("dflash", {"dflash.aux_layers": [1, 2, 9]}, "reads hidden state 9, but the target has 4 layers"),
    ("dflash", {"dflash.block_size": 100000}, "longer than max_length"),
    ("dflash", {"dflash.mask_token_id": 99999}, "'dflash.mask_token_id' is 99999, but the target's vocabulary"),
    ("dflash", {"dflash.init_layer": 17}, "'dflash.init_layer' = 17, but the target has 4 decoder layers"),
    ("eagle3", {"eagle.init_layer": 17}, "'eagle.init_layer' = 17, but the target has 4 decoder layers"),
    ("eagle3", {"eagle.init_layer": -5}, "'eagle.init_layer' = -5"),
    ("eagle3", {"eagle.draft_vocab_size": 100000}, "more than the target's vocabulary"),
    ("medusa", {"medusa.draft_vocab_size": 100000}, "more than the target's vocabulary"),
]


@pytest.mark.parametrize("kind,bad,message", LIMITS)
def test_target_limits_are_refused_before_anything_is_written_and_the_fix_runs(setup, tmp_path, kind, bad, message):
    out = tmp_path / "run"
    with pytest.raises(TrainError, match=message):
        train(config(setup, out, kind, **bad))
    assert not out.exists()  # no run.json: the corrected rerun is not "another run"
    assert train(config(setup, out, kind)).name == "final"


def test_the_cli_refuses_a_target_limit_on_one_line(setup, tmp_path, capsys):
    from headway.cli import main

    _, target, data = setup
    code = main(["train", "kind=dflash", f"target={target}", f"data={data}", f"output_dir={tmp_path / 'r'}",
                 "dflash.aux_layers=[1,2,9]", "max_steps=1", "progress=false"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err and "hidden state 9" in err


@pytest.mark.parametrize("layers", [[1, 1, 2], [3, 1, 2], [2, 1]])
@pytest.mark.parametrize("section", ["eagle", "dflash"])
def test_fused_layers_must_be_strictly_increasing(section, layers):
    with pytest.raises(ConfigError, match=f"'{section}.aux_layers' must be strictly increasing"):
        load_config(TrainConfig, None, {"kind": "dflash", "target": "t", f"{section}.aux_layers": layers})
    ok = load_config(TrainConfig, None, {"kind": "dflash", "target": "t", f"{section}.aux_layers": sorted(set(layers))})
    assert getattr(ok, section).aux_layers == sorted(set(layers))


def test_eagle3_fuses_three_layers():
    with pytest.raises(ConfigError, match="exactly 3 target layers"):
        load_config(TrainConfig, None, {"kind": "eagle3", "target": "t", "eagle.aux_layers": [1, 2]})


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_init_from_and_init_layer_are_one_choice(kind):
    section = "eagle" if kind == "eagle3" else "dflash"
    with pytest.raises(ConfigError, match=f"init_from and {section}.init_layer"):
        load_config(TrainConfig, None, {"kind": kind, "target": "t", "init_from": "h", f"{section}.init_layer": 1})
