"""Issue #63, bad input probed as a new user would: every probe is one ``headway <cmd>: error:``
line with rc 2, no traceback, and loses nothing. ``export`` / ``import`` write only into a new
folder or one holding an earlier export of the same kind, never into or above their input; output
paths that cannot work are refused up front; every import fault is one line; ``--limit`` >= 1; a
``data_files`` pattern that matches nothing is named."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from headway.cli import main
from headway.heads import DFlashDrafter, Eagle3Drafter, HeadsError, MedusaHeads
from headway.heads.export import ExportError, export_heads
from headway.testing import save_tiny_target, tiny_target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A saved 4-layer target, and EAGLE-3, Medusa and DFlash heads for it."""
    root = tmp_path_factory.mktemp("probes")
    target_dir = save_tiny_target(root / "target", "llama", num_hidden_layers=4)
    model, _ = tiny_target("llama", num_hidden_layers=4)
    eagle3 = Eagle3Drafter.for_target(model, draft_vocab_size=100, aux_layers=[1, 2, 3])
    eagle3.set_draft_vocab(torch.arange(0, 300, 3))
    heads = {"eagle3": eagle3, "medusa": MedusaHeads.for_target(model, num_heads=2),
             "dflash": DFlashDrafter.for_target(model, mask_token_id=4, block_size=4, aux_layers=[1, 3])}
    for h in heads.values():
        h.target_info.name_or_path = "someorg/tiny-llama"  # the speculators format names its verifier
    return target_dir, {kind: h.save_pretrained(root / kind) for kind, h in heads.items()}


@pytest.fixture
def work(tiny, tmp_path, monkeypatch):
    """A fresh working folder (the cwd) with copies of the heads: eagle3/, medusa/, dflash/."""
    for kind, folder in tiny[1].items():
        shutil.copytree(folder, tmp_path / kind)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def one_line_error(capsys, argv: list[str]) -> str:
    """Run the CLI, expect exit status 2 and exactly one line on stderr; return it."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def tree_hash(folder: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under ``folder`` (and "name/" for every folder)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        out[rel + "/" if p.is_dir() else rel] = "" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def run_folder(root: Path, heads: Path) -> Path:
    """What a training run leaves: checkpoints, a log and final heads."""
    (root / "checkpoints" / "step-2").mkdir(parents=True)
    (root / "checkpoints" / "step-2" / "state.pt").write_bytes(b"optimizer state")
    (root / "log.jsonl").write_text('{"step": 1, "loss": 2.5}\n')
    shutil.copytree(heads, root / "final")
    return root


# -- gap 1: export and import replace only an earlier export of the same kind ------------------------
def test_export_into_the_run_folder_above_its_heads_is_refused(work, capsys):
    """`export R/final --out R` deleted the checkpoints, the log and the heads themselves."""
    run = run_folder(work / "R", work / "eagle3")
    before = tree_hash(run)
    err = one_line_error(capsys, ["export", "R/final", "--format", "vllm", "--out", "R"])
    assert err == "headway export: error: --out R holds the input R/final; choose a new folder outside it"
    assert tree_hash(run) == before


@pytest.mark.parametrize("out, why", [("eagle3", "is the input eagle3 itself"),
                                      ("eagle3/engine", "is inside the input eagle3"),
                                      (".", "is the current folder")])
def test_export_never_writes_into_or_around_its_input(work, capsys, out, why):
    before = tree_hash(work)
    err = one_line_error(capsys, ["export", "eagle3", "--format", "vllm", "--out", out])
    assert err.startswith(f"headway export: error: --out {out} {why}")
    assert tree_hash(work) == before


def test_export_into_a_folder_of_other_files_is_refused_naming_them(work, capsys):
    run = run_folder(work / "R", work / "eagle3")
    before = tree_hash(run)
    err = one_line_error(capsys, ["export", "eagle3", "--format", "vllm", "--out", "R"])
    assert err == ("headway export: error: --out R holds files that are not an earlier headway export "
                   "(checkpoints/, final/, log.jsonl); choose a new folder")
    assert tree_hash(run) == before
    (work / "v2").mkdir()
    (work / "v2" / "notes.txt").write_text("mine")
    err = one_line_error(capsys, ["export", "eagle3", "--format", "vllm", "--out", "v2"])
    assert "(notes.txt)" in err and (work / "v2" / "notes.txt").read_text() == "mine"


def test_export_replaces_an_earlier_export_of_the_same_format_only(work, capsys):
    assert main(["export", "eagle3", "--format", "vllm", "--out", "E"]) == 0
    first = tree_hash(work / "E")
    assert main(["export", "eagle3", "--format", "vllm", "--out", "E", "--dtype", "bfloat16"]) == 0  # replaced
    assert tree_hash(work / "E") != first and set(tree_hash(work / "E")) == set(first)
    capsys.readouterr()
    again = tree_hash(work / "E")
    err = one_line_error(capsys, ["export", "eagle3", "--format", "sglang", "--out", "E"])
    assert err == "headway export: error: --out E holds a vllm export, not a sglang one; choose a new folder"
    (work / "E" / "notes.txt").write_text("mine")  # an earlier export with something of the user's in it
    err = one_line_error(capsys, ["export", "eagle3", "--format", "vllm", "--out", "E"])
    assert "not an earlier headway export (notes.txt)" in err
    assert tree_hash(work / "E") == {**again, "notes.txt": hashlib.sha256(b"mine").hexdigest()}
    (work / "empty").mkdir()  # an empty folder is as good as a new one
    assert main(["export", "eagle3", "--format", "vllm", "--out", "empty"]) == 0


@pytest.mark.parametrize("command", ["export", "import"])
@pytest.mark.parametrize("out", [".", "..", "~"])
def test_the_current_folder_is_never_replaced(work, capsys, monkeypatch, command, out):
    """`--out .` failed with "PosixPath('.') has an empty name"; resolved, replacing the folder whole
    (the atomic publish) would leave the shell in a deleted folder, even where it held an export."""
    assert main(["export", "eagle3", "--format", "vllm", "--out", "here/E"]) == 0
    assert main(["export", "eagle3", "--format", "vllm", "--out", "E2"]) == 0  # what the import reads
    monkeypatch.chdir(work / "here" / "E")
    monkeypatch.setenv("HOME", str(work))
    capsys.readouterr()
    before = tree_hash(work)
    argv = ["export", str(work / "eagle3"), "--format", "vllm"] if command == "export" else ["import", str(work / "E2")]
    err = one_line_error(capsys, [*argv, "--out", out])
    assert err == (f"headway {command}: error: --out {out} {'is' if out == '.' else 'holds'} the current folder, and "
                   "the output replaces its folder whole; name a new folder")
    assert tree_hash(work) == before


def test_import_never_replaces_its_source_or_other_files(work, capsys):
    assert main(["export", "eagle3", "--format", "vllm", "--out", "E"]) == 0
    capsys.readouterr()
    before = tree_hash(work)
    err = one_line_error(capsys, ["import", "E", "--out", "E"])
    assert err == "headway import: error: --out E is the input E itself; choose a new folder"
    err = one_line_error(capsys, ["import", "E/model.safetensors", "--out", "E"])  # the folder holding the file
    assert err.endswith("--out E holds the input E/model.safetensors; choose a new folder outside it")
    (work / "v2").mkdir()
    (work / "v2" / "notes.txt").write_text("x")
    err = one_line_error(capsys, ["import", "E", "--out", "v2"])
    assert err == ("headway import: error: --out v2 holds files that are not an earlier headway heads checkpoint "
                   "(notes.txt); choose a new folder")
    assert tree_hash(work) == {**before, "v2/": "", "v2/notes.txt": hashlib.sha256(b"x").hexdigest()}


def test_import_replaces_an_earlier_checkpoint_of_the_same_kind_only(work, capsys):
    assert main(["export", "eagle3", "--format", "vllm", "--out", "E"]) == 0
    assert main(["export", "medusa", "--format", "vllm", "--out", "M"]) == 0
    assert main(["import", "E", "--out", "I"]) == 0
    assert main(["import", "E", "--out", "I"]) == 0  # an earlier import of the same kind: replaced
    capsys.readouterr()
    before = tree_hash(work / "I")
    err = one_line_error(capsys, ["import", "M", "--out", "I"])
    assert err == "headway import: error: --out I holds eagle3 heads, not medusa ones; choose a new folder"
    assert tree_hash(work / "I") == before
    (work / "I" / "adapter").mkdir()  # a Medusa-2 checkpoint's adapter, say: not what an import writes
    err = one_line_error(capsys, ["import", "E", "--out", "I"])
    assert "not an earlier headway heads checkpoint (adapter/)" in err


def test_the_library_functions_refuse_before_any_work(work):
    """Python callers get the same protection as the command line."""
    from headway.heads.importers import import_checkpoint

    run = run_folder(work / "R", work / "eagle3")
    before = tree_hash(run)
    with pytest.raises(ExportError, match="holds the input"):
        export_heads(run / "final", "vllm", run)
    with pytest.raises(ExportError, match="not an earlier headway export"):
        export_heads(work / "medusa", "vllm", run)
    assert export_heads(work / "eagle3", "vllm", work / "E") == (work / "E").resolve()
    with pytest.raises(HeadsError, match="holds files that are not an earlier headway heads checkpoint"):
        import_checkpoint(work / "E", run)
    with pytest.raises(HeadsError, match="is the input"):
        import_checkpoint(work / "E", work / "E")
    assert tree_hash(run) == before
    assert import_checkpoint(work / "E", work / "I").kind == "eagle3"


# -- gap 5: output paths that cannot work are refused up front ---------------------------------------
def output_probes(target: str) -> dict[str, list[str]]:
    """command -> argv with OUT where the output path goes (every other argument valid)."""
    return {
        "export": ["export", "eagle3", "--format", "vllm", "--out", "OUT"],
        "import": ["import", "E", "--out", "OUT"],
        "distill": ["distill", "p.jsonl", "--target", target, "--output", "OUT"],
        "features": ["features", "DS", "--target", target, "--output", "OUT"],
        "tokenize": ["tokenize", "qa.jsonl", "--target", target, "--output", "OUT"],
        "prompts": ["prompts", "--target", target, "--output", "OUT"],
        "merge": ["merge", "DS", "DS2", "--output", "OUT"],
        "train": ["train", "--target", target, "data=DS", "output_dir=OUT"],
        "target build": ["target", "build", "--out", "OUT"],
        "demo": ["demo", "--run-dir", "OUT"],
    }


@pytest.fixture
def inputs(tiny, work, capsys):
    """Valid inputs for every command of ``output_probes``: prompts, a tokenized dataset, an export."""
    (work / "p.jsonl").write_text('{"prompt": "def f():"}\n')
    (work / "qa.jsonl").write_text('{"prompt": "Hi", "completion": "Hello"}\n{"prompt": "Yo", "completion": "Hey"}\n')
    target = str(tiny[0])
    assert main(["tokenize", "qa.jsonl", "--target", target, "--output", "DS"]) == 0
    shutil.copytree(work / "DS", work / "DS2")
    assert main(["export", "eagle3", "--format", "vllm", "--out", "E"]) == 0
    (work / "afile").write_text("a user's file")
    capsys.readouterr()
    return output_probes(target)


@pytest.mark.parametrize("out", ["afile", "afile/sub"])
@pytest.mark.parametrize("command", list(output_probes("T")))
def test_an_output_path_that_cannot_work_is_one_line(work, inputs, capsys, command, out):
    argv = [a.replace("OUT", out) for a in inputs[command]]
    before = tree_hash(work)
    err = one_line_error(capsys, argv)
    assert err.startswith(f"headway {command}: error: ")
    assert f"{out} is a file, not a folder" in err if out == "afile" else "afile is a file, not a folder" in err
    assert tree_hash(work) == before


@pytest.mark.parametrize("argv, flag", [(["bench", "--heads", "eagle3", "--json", "DIR"], "--json"),
                                        (["bench", "--heads", "eagle3", "--plot", "DIR"], "--plot"),
                                        (["tune", "--heads", "eagle3", "--json-out", "DIR"], "--json-out")])
def test_a_report_file_that_cannot_be_written_is_refused_before_measuring(tiny, work, capsys, argv, flag):
    (work / "DIR").mkdir()
    err = one_line_error(capsys, [*argv, "--target", str(tiny[0])])
    assert err.endswith(f"{flag} DIR is a folder; give a file name")
    (work / "afile").write_text("x")
    err = one_line_error(capsys, [*[a.replace("DIR", "afile/r.json") for a in argv], "--target", str(tiny[0])])
    assert err.endswith(f"{flag} afile/r.json: afile is a file, not a folder")


@pytest.mark.parametrize("command, argv", [
    ("features", ["features", "sub/DS", "--target", "TARGET", "--output", "sub", "--overwrite"]),
    ("features", ["features", "sub/DS", "--target", "TARGET", "--output", "sub/DS", "--overwrite"]),
    ("merge", ["merge", "sub/DS", "DS2", "--output", "sub", "--overwrite"]),
    ("distill", ["distill", "sub/p.jsonl", "--target", "TARGET", "--output", "sub", "--overwrite"]),
    ("distill", ["distill", "p.jsonl", "--target", "sub/target", "--output", "sub", "--overwrite"]),
    ("tokenize", ["tokenize", "sub/qa.jsonl", "--target", "TARGET", "--output", "sub", "--overwrite"]),
    ("prompts", ["prompts", "--target", "sub/target", "--output", "sub", "--overwrite"]),
])
def test_overwrite_never_empties_a_folder_that_holds_an_input(tiny, work, inputs, capsys, command, argv):
    """`features runs/distilled --output runs --overwrite` emptied runs/, the dataset with it."""
    sub = work / "sub"
    sub.mkdir()
    for name in ("p.jsonl", "qa.jsonl"):
        shutil.copy(work / name, sub / name)
    shutil.move(work / "DS", sub / "DS")
    shutil.copytree(tiny[0], sub / "target")
    before = tree_hash(work)
    err = one_line_error(capsys, [a.replace("TARGET", str(tiny[0])) for a in argv])
    assert err.startswith(f"headway {command}: error: output folder ")
    assert "sub holds the input" in err or "sub/DS is the input" in err
    assert tree_hash(work) == before


# -- gap 6: every import error is one line -------------------------------------------------------------
PEERS = [("eagle3", "vllm"), ("eagle3", "sglang"), ("eagle3", "speculators"), ("dflash", "vllm"),
         ("dflash", "speculators"), ("medusa", "vllm"), ("medusa", "trtllm")]


def truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


@pytest.fixture
def exported(work, capsys):
    """kind-format -> an export folder of every peer layout the importers read."""
    folders = {}
    for kind, fmt in PEERS:
        assert main(["export", kind, "--format", fmt, "--out", f"{kind}-{fmt}"]) == 0
        folders[f"{kind}-{fmt}"] = work / f"{kind}-{fmt}"
    capsys.readouterr()
    return folders


@pytest.mark.parametrize("peer", [f"{k}-{f}" for k, f in PEERS])
def test_a_truncated_peer_checkpoint_is_one_line(exported, capsys, peer):
    """`SafetensorError: incomplete metadata` came with a traceback (native heads had a clean line)."""
    (f,) = exported[peer].glob("*.safetensors")
    truncate(f)
    err = one_line_error(capsys, ["import", peer, "--out", "I"])
    assert err == (f"headway import: error: {peer}/{f.name}: not a readable safetensors file (incomplete metadata, "
                   "file not fully covered); it is probably truncated or corrupt")
    assert not Path("I").exists()


CONFIG_FAULTS = {  # config.json -> what the one line says
    "invalid": (lambda c: "{", "config.json: invalid JSON at line 1"),
    "list": (lambda c: "[1]", "config.json: expected a JSON object {...} at the top level, got a JSON list"),
    "wrong-type": (lambda c: json.dumps({**c, "hidden_size": "abc"}), "hidden_size"),
}


@pytest.mark.parametrize("peer, fault", [(peer, fault) for peer in ("eagle3-vllm", "eagle3-speculators", "dflash-vllm",
                                                                   "dflash-speculators", "medusa-vllm")
                                         for fault in CONFIG_FAULTS
                                         if fault != "wrong-type" or peer in ("eagle3-vllm", "dflash-vllm")])
def test_a_garbled_peer_config_is_one_line(exported, capsys, peer, fault):
    f = exported[peer] / "config.json"
    body, what = CONFIG_FAULTS[fault]
    f.write_text(body(json.loads(f.read_text())))
    err = one_line_error(capsys, ["import", peer, "--out", "I"])
    assert err.startswith("headway import: error: ") and what in err


@pytest.mark.parametrize("peer, edit", [
    ("dflash-vllm", lambda c: {**c, "dflash_config": "x"}),
    ("dflash-vllm", lambda c: {**c, "dflash_config": {}}),
    ("dflash-vllm", lambda c: {**c, "num_attention_heads": 0}),
    ("dflash-speculators", lambda c: {**c, "transformer_layer_config": {**c["transformer_layer_config"],
                                                                        "rope_parameters": 5}}),
    ("medusa-vllm", lambda c: {**c, "vocab_size": "big"}),
])
def test_an_incomplete_peer_config_is_one_line(exported, capsys, peer, edit):
    f = exported[peer] / "config.json"
    f.write_text(json.dumps(edit(json.loads(f.read_text()))))
    err = one_line_error(capsys, ["import", peer, "--out", "I"])
    assert err.startswith("headway import: error: ")


def test_a_sharded_peer_checkpoint_missing_a_shard_is_one_line(exported, capsys):
    folder = exported["eagle3-vllm"]
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"fc.weight": "part-2.safetensors"}}))
    err = one_line_error(capsys, ["import", "eagle3-vllm", "--out", "I"])
    assert err == "headway import: error: eagle3-vllm has no part-2.safetensors"
    (folder / "model.safetensors.index.json").write_text('{"weight_map": 3}')
    err = one_line_error(capsys, ["import", "eagle3-vllm", "--out", "I"])
    assert err.endswith("model.safetensors.index.json has no 'weight_map' object")


# -- gap 7: --limit >= 1 -------------------------------------------------------------------------------
@pytest.mark.parametrize("command, limit", [("distill", "-1"), ("distill", "0"), ("features", "-1"),
                                            ("features", "0"), ("tokenize", "0"), ("distill --skip", "-1")])
def test_a_limit_below_one_is_refused_and_writes_nothing(work, inputs, capsys, command, limit):
    """distill --limit -1 was an islice traceback; features --limit 0 an empty folder called complete."""
    argv = {"distill": inputs["distill"], "features": inputs["features"], "tokenize": inputs["tokenize"],
            "distill --skip": inputs["distill"]}[command]
    flag = "--skip" if command.endswith("--skip") else "--limit"
    err = one_line_error(capsys, [a.replace("OUT", "out") for a in argv] + [flag, limit])
    rule = "'skip' must be >= 0" if flag == "--skip" else "'limit' must be >= 1"
    assert err == f"headway {command.split()[0]}: error: {rule}, got {limit}"
    assert not (work / "out").exists()


# -- gap 8: data_files ---------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, want", [
    ('{path: json, data_files: "x/*.jsonl"}', "data_files 'x/*.jsonl' matches no file"),
    ('{path: json, data_files: ["qa.jsonl", "x/**"]}', "data_files 'x/**' matches no file"),
    ('{path: data, data_files: "*.parquet"}', "data_files '*.parquet' matches no file in data"),
    ('{path: qa.jsonl, data_files: "*.jsonl"}', "qa.jsonl is a file: data_files (*.jsonl) pick files inside a "
                                                "folder or a Hub dataset"),
])
def test_data_files_that_match_nothing_are_named(work, inputs, capsys, spec, want):
    (work / "data").mkdir()
    shutil.copy(work / "qa.jsonl", work / "data" / "qa.jsonl")
    argv = [spec if a == "qa.jsonl" else a.replace("OUT", "out") for a in inputs["tokenize"]]
    err = one_line_error(capsys, argv)
    assert err.startswith("headway tokenize: error: " + want)
    assert not (work / "out").exists()


def test_a_data_files_glob_reads_its_files(work, inputs):
    """`data_files: "*.jsonl"` was read as a YAML alias ("while scanning an alias"), over many lines."""
    from headway.data.sources import read_samples

    (work / "data").mkdir()
    shutil.copy(work / "qa.jsonl", work / "data" / "qa.jsonl")
    got = read_samples('{path: data, data_files: "*.jsonl"}')
    assert [s.prompt for s in got.samples] == ["Hi", "Yo"]
    assert [s.prompt for s in read_samples('{path: json, data_files: "data/*.jsonl"}').samples] == ["Hi", "Yo"]
