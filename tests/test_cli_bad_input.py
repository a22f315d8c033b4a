"""Issue #14, bad input never passes silently: prompt files are read row-exact (a bad byte costs
its own line and nothing else), broken checkpoint / target / config files are one clear error
line, non-finite heads are refused, heads know their tokenizer, published folders follow the umask."""

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from headway.cli import main
from headway.data.errors import BadRowError, DataError
from headway.data.sources import read_samples
from headway.heads import HeadsError, MedusaHeads, load_heads
from headway.heads.base import TOKENIZER_KEY
from headway.heads.export import ExportError, export_heads
from headway.target import TargetError, load_target
from headway.testing import save_tiny_target, tiny_target, tiny_tokenizer
from headway.tokenizer import tokenizer_fingerprint


@pytest.fixture(scope="module")
def target():
    model, _ = tiny_target("llama", num_hidden_layers=2)
    return model


@pytest.fixture
def heads_dir(target, tmp_path):
    heads = MedusaHeads.for_target(target, num_heads=2)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.05)
    return heads.save_pretrained(tmp_path / "heads")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("target") / "llama", "llama", num_hidden_layers=2)


def one_line_error(capsys, argv: list[str]) -> str:
    """Run the CLI, expect exit status 2 and exactly one line on stderr; return it."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


# -- 1. prompt files are read row-exact -----------------------------------------------------------
ROWS = [json.dumps({"prompt": f"row {i}"}).encode() for i in range(2001)]
BAD = b'{"prompt": "caf\xe9 au lait"}'  # latin-1, not UTF-8


def test_jsonl_bad_byte_is_its_own_line_and_costs_nothing_else(tmp_path):
    rows = list(ROWS)
    rows[1000] = BAD  # line 1001 of 2001
    p = tmp_path / "p.jsonl"
    p.write_bytes(b"\n".join(rows) + b"\n")
    with pytest.raises(BadRowError) as e:
        read_samples(str(p))
    assert str(e.value).startswith(f"{p}:1001: not UTF-8 (byte 0xe9")
    res = read_samples(str(p), skip_bad_rows=True)
    assert len(res.samples) == 2000 and len(res.bad) == 1 and res.bad[0].startswith(f"{p}:1001:")
    assert [s.prompt for s in res.samples[999:1001]] == ["row 999", "row 1001"]
    assert res.samples[-1].id == "2000"  # ids (the line index) are unchanged by the bad row


def test_jsonl_bom_and_crlf_are_read(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + b"\r\n".join(ROWS[:3]) + b"\r\n")
    assert [s.prompt for s in read_samples(str(p)).samples] == ["row 0", "row 1", "row 2"]


@pytest.mark.parametrize("layout", ["pretty", "one-line", "data-key"])
def test_json_array_bad_byte_is_one_bad_row(tmp_path, layout):
    chat = [json.dumps({"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}).encode()
            for i in range(5)]
    chat[2] = b'{"conversations": [{"from": "human", "value": "\xff"}]}'  # ShareGPT JSON, one bad row
    body = {"pretty": b"[\n" + b",\n".join(chat) + b"\n]\n", "one-line": b"[" + b", ".join(chat) + b"]",
            "data-key": b'{"data": [\n' + b",\n".join(chat) + b"\n]}\n"}[layout]
    p = tmp_path / "sharegpt.json"
    p.write_bytes(body)
    line = 1 if layout == "one-line" else 4
    with pytest.raises(BadRowError, match=rf"^{p}:{line}: not UTF-8 \(byte 0xff"):
        read_samples(str(p))
    res = read_samples(str(p), skip_bad_rows=True)
    assert [s.messages[0]["content"] for s in res.samples] == ["q0", "q1", "q3", "q4"]
    assert [s.id for s in res.samples] == ["0", "1", "3", "4"] and len(res.bad) == 1


def test_json_array_rows_are_located_by_line(tmp_path):
    p = tmp_path / "p.json"
    p.write_text('[\n  {"prompt": "ok"},\n  {"prompt": ""},\n  {"prompt": "ok too"}\n]\n')
    with pytest.raises(BadRowError, match=rf"^{p}:3: empty prompt"):
        read_samples(str(p))
    p.write_text('[\n  {"prompt": "ok"},\n  {"prompt": "x" "y"}\n]\n')  # broken structure: no row can be trusted
    with pytest.raises(DataError, match=rf"^{p}:3: invalid JSON"):
        read_samples(str(p))


# -- 2. broken files are one clear line -----------------------------------------------------------
def truncated(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


GARBLED_JSON = {
    "invalid": (b'{"kind": "medusa",', "invalid JSON at line 1"),
    "not-utf8": (b'{"kind": "med\xffusa"}', "not UTF-8 (byte 0xff at line 1, column 14)"),
    "list": (b'["kind", "medusa"]', "expected a JSON object {...} at the top level, got a JSON list"),
    "empty": (b"", "the file is empty"),
}


@pytest.mark.parametrize("case", ["empty", "truncated"])
def test_broken_heads_weights_are_one_line(heads_dir, tmp_path, capsys, case):
    f = heads_dir / "model.safetensors"
    f.write_bytes(b"") if case == "empty" else truncated(f)
    with pytest.raises(HeadsError, match=f"^{f}: " + ("the file is empty" if case == "empty" else
                                                     "not a readable safetensors file")):
        load_heads(heads_dir)
    err = one_line_error(capsys, ["export", str(heads_dir), "--format", "vllm", "--out", str(tmp_path / "x")])
    assert str(f) in err


@pytest.mark.parametrize("case", GARBLED_JSON)
def test_garbled_heads_config_is_one_line(heads_dir, tmp_path, capsys, case):
    body, what = GARBLED_JSON[case]
    (heads_dir / "config.json").write_bytes(body)
    with pytest.raises(HeadsError) as e:
        MedusaHeads.from_pretrained(heads_dir)
    assert str(e.value).startswith(f"{heads_dir / 'config.json'}: ") and what in str(e.value)
    err = one_line_error(capsys, ["export", str(heads_dir), "--format", "vllm", "--out", str(tmp_path / "x")])
    assert what in err


@pytest.mark.parametrize("case", ["weights-empty", "weights-truncated", *GARBLED_JSON])
def test_broken_target_folder_is_one_line(target_dir, tmp_path, case):
    d = tmp_path / "target"
    shutil.copytree(target_dir, d)
    if case.startswith("weights"):
        f = d / "model.safetensors"
        f.write_bytes(b"") if case == "weights-empty" else truncated(f)
        what = "the file is empty" if case == "weights-empty" else "not a readable safetensors file"
    else:
        f = d / "config.json"
        body, what = GARBLED_JSON[case]
        f.write_bytes(body)
    with pytest.raises(TargetError) as e:
        load_target(str(d), device="cpu")
    assert str(e.value).startswith(f"{f}: ") and what in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name, body, what", [
    ("c.yaml", b"source: [a, b\nmax_new_tokens: 3\n", "invalid YAML at line 2"),
    ("c.yaml", b"source: p.jsonl\n  bad: indent\n", "invalid YAML at line 2, column 6"),
    ("c.yaml", b"source: caf\xe9.jsonl\n", "not UTF-8 (byte 0xe9 at line 1, column 12)"),
    ("c.yaml", b"- source\n- p.jsonl\n", "the top level must be a mapping of keys to values, got a list"),
    ("c.json", b'{"source": "p.jsonl",}', "invalid JSON at line 1, column 22"),
    ("c.json", b'["source"]', "expected a JSON object {...} at the top level, got a JSON list"),
])
def test_garbled_command_config_is_one_line(tmp_path, capsys, name, body, what):
    f = tmp_path / name
    f.write_bytes(body)
    err = one_line_error(capsys, ["distill", "--config", str(f)])
    assert err.startswith(f"headway distill: error: {f}: ") and what in err


# -- 3. non-finite heads --------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_heads_are_refused_on_load_save_and_export(heads_dir, tmp_path, bad):
    f = heads_dir / "model.safetensors"
    tensors = {k: v.clone() for k, v in load_file(str(f)).items()}  # not mmapped: f is rewritten
    name = sorted(tensors)[1]
    tensors[name][0, 0] = bad
    save_file(tensors, str(f))
    with pytest.raises(HeadsError, match=f"tensor '{name}' has"):
        load_heads(heads_dir)
    with pytest.raises(ExportError, match=f"tensor '{name}' has"):
        export_heads(heads_dir, "vllm", tmp_path / "out")
    assert not (tmp_path / "out").exists()

    heads = MedusaHeads.for_target(tiny_target("llama", num_hidden_layers=2)[0], num_heads=2)
    with torch.no_grad():
        dict(heads.named_parameters())[name].view(-1)[3] = bad
    with pytest.raises(HeadsError, match=f"refusing to save medusa heads to .*tensor '{name}' has"):
        heads.save_pretrained(tmp_path / "nan-heads")
    assert not (tmp_path / "nan-heads").exists() and not list(tmp_path.glob(".nan-heads*"))


def test_push_refuses_truncated_or_non_finite_weights(heads_dir, monkeypatch):
    from headway.heads.hub import HubError, push_heads

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # fail on the checkpoint, before any network step
    monkeypatch.setattr("headway.heads.hub.push_folder", lambda *a, **k: pytest.fail("pushed a bad checkpoint"))
    f = heads_dir / "model.safetensors"
    tensors = {k: v.clone() for k, v in load_file(str(f)).items()}  # not mmapped: f is rewritten
    truncated(f)
    with pytest.raises(HubError, match=f"^{f}: not a readable safetensors file"):
        push_heads(heads_dir, "someorg/heads")
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, str(f))
    with pytest.raises(HubError, match=f"tensor '{name}' has 1 NaN"):
        push_heads(heads_dir, "someorg/heads")


# -- 4. tokenizer fingerprint ---------------------------------------------------------------------
def swapped(tok):
    """The same tokenizer with two tokens' ids exchanged: same size, other meaning."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    a, b = [k for k, v in vocab.items() if v in (300, 301)]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   bos_token=tok.bos_token, eos_token=tok.eos_token, pad_token=tok.pad_token)


def test_tokenizer_fingerprint_is_stable_and_sensitive(target_dir):
    tok = tiny_tokenizer()
    fp = tokenizer_fingerprint(tok)
    assert fp.startswith("sha256:") and len(fp) == len("sha256:") + 16
    _, reloaded = load_target(str(target_dir), device="cpu")  # what training and decoding both see
    assert tokenizer_fingerprint(reloaded) == fp
    assert tokenizer_fingerprint(swapped(tok)) != fp and len(swapped(tok)) == len(tok)


def test_heads_refuse_a_tokenizer_other_than_their_training_one(target, tmp_path):
    tok = tiny_tokenizer()
    heads = MedusaHeads.for_target(target, num_heads=2)
    heads.record_tokenizer(tok)
    path = heads.save_pretrained(tmp_path / "h")
    assert json.loads((path / "config.json").read_text())["metadata"][TOKENIZER_KEY] == tokenizer_fingerprint(tok)
    load_heads(path, target=target, tokenizer=tok)  # same tokenizer: fine
    other = swapped(tok)
    with pytest.raises(HeadsError) as e:
        load_heads(path, target=target, tokenizer=other)
    msg = str(e.value)
    assert tokenizer_fingerprint(tok) in msg and tokenizer_fingerprint(other) in msg
    with pytest.raises(HeadsError, match="fingerprint"):
        MedusaHeads.from_pretrained(path).attach(target, tokenizer=other)


def test_heads_without_a_fingerprint_load_with_any_tokenizer(heads_dir, target):
    assert TOKENIZER_KEY not in json.loads((heads_dir / "config.json").read_text())["metadata"]
    load_heads(heads_dir, target=target, tokenizer=swapped(tiny_tokenizer()))


# -- 5. published folders follow the umask --------------------------------------------------------
@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_heads_and_export_folders_follow_the_umask(target, tmp_path, umask):
    old = os.umask(umask)
    try:
        heads = MedusaHeads.for_target(target, num_heads=2)
        saved = heads.save_pretrained(tmp_path / "heads")
        exported = export_heads(saved, "vllm", tmp_path / "export")
        again = heads.save_pretrained(tmp_path / "heads")  # replacing an existing folder too
    finally:
        os.umask(old)
    for folder in (saved, exported, again):
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o777 & ~umask
        for f in folder.iterdir():
            assert stat.S_IMODE(os.stat(f).st_mode) == 0o666 & ~umask


def test_the_decoder_refuses_heads_trained_with_another_tokenizer(target, tmp_path):
    from headway.decode import Speculator

    tok = tiny_tokenizer()
    heads = MedusaHeads.for_target(target, num_heads=2)
    heads.record_tokenizer(tok)
    path = heads.save_pretrained(tmp_path / "h")
    Speculator.from_pretrained(target, path, tokenizer=tok)  # the training tokenizer: fine
    with pytest.raises(HeadsError, match="fingerprint"):
        Speculator.from_pretrained(target, path, tokenizer=swapped(tok))


# -- 6. issue #46: the last gaps found by probing the CLI -------------------------------------------
def prompts_with_bad_rows(path: Path) -> tuple[Path, dict[int, str]]:
    """40 prompt lines, 7 of them bad (an empty prompt, broken JSON, a non-UTF-8 byte): {line: reason}."""
    bad = {3: "empty prompt", 5: "invalid JSON", 7: "empty prompt", 11: "empty prompt", 13: "not UTF-8",
           31: "invalid JSON", 35: "empty prompt"}
    lines = []
    for n in range(1, 41):
        reason = bad.get(n)
        lines.append(b'{"prompt": ""}' if reason == "empty prompt" else b'{"prompt": "x' if reason == "invalid JSON"
                     else BAD if reason == "not UTF-8" else json.dumps({"prompt": f"def f{n}():"}).encode())
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path, bad


@pytest.mark.parametrize("command", ["distill", "tokenize"])
def test_every_skipped_row_is_listed_the_first_few_on_the_terminal(target_dir, tmp_path, capsys, command):
    """Only the first bad row was named ("skipped 7 bad row(s); first: p.jsonl:3: ..."): line 31's
    broken JSON never appeared. Now the terminal names the first five and counts the rest, and the
    manifest lists every one with its line."""
    src, bad = prompts_with_bad_rows(tmp_path / "p.jsonl")
    if command == "tokenize":  # rows with answers
        lines = src.read_bytes().split(b"\n")
        src.write_bytes(b"\n".join(line.replace(b'"}', b'", "completion": "pass"}') if b"def f" in line else line
                                   for line in lines))
    out = tmp_path / "out"
    args = [command, str(src), "--target", str(target_dir), "--output", str(out), "--skip-bad-rows"]
    if command == "distill":
        args += ["--max-new-tokens", "2", "--device", "cpu", "--linear-kernel", "stock"]
    assert main(args) == 0
    err = capsys.readouterr().err
    manifest = json.loads((out / f"headway_{command}.json").read_text())
    assert manifest["bad_rows_skipped"] == 7 and len(manifest["bad_rows"]) == 7
    for row, (line, reason) in zip(manifest["bad_rows"], sorted(bad.items())):
        assert row.startswith(f"{src}:{line}: {reason}"), row
    shown = [line.strip() for line in err.splitlines() if line.startswith(f"  {src}:")]
    assert shown == manifest["bad_rows"][:5]
    assert "skipped 7 bad row(s):" in err
    assert f"... and 2 more: every bad row is listed under 'bad_rows' in {out / f'headway_{command}.json'}" in err


@pytest.mark.parametrize("case", ["source-missing", "source-empty", "wrong-field", "target-missing", "all-bad"])
def test_a_distill_that_refuses_to_start_leaves_no_folder_and_no_lock(target_dir, tmp_path, capsys, case):
    src = tmp_path / "p.jsonl"
    src.write_text({"source-empty": "", "wrong-field": '{"text": "def f():"}\n',
                    "all-bad": '{"prompt": ""}\n{"text": "x"}\n'}.get(case, '{"prompt": "x"}\n'))
    source = str(tmp_path / "nope.jsonl") if case == "source-missing" else str(src)
    target = str(tmp_path / "no-target") if case == "target-missing" else str(target_dir)
    out = tmp_path / "runs" / "distilled"
    skip = ["--skip-bad-rows"] if case == "all-bad" else []
    err = one_line_error(capsys, ["distill", source, "--target", target, "--output", str(out), *skip])
    assert not (tmp_path / "runs").exists()
    if case == "all-bad":  # not one row to distil: the error names the first bad one
        assert err.endswith(f"no usable prompts in {src} (2 bad rows; the first: {src}:1: empty prompt)")
    (tmp_path / "mine").mkdir()  # a folder that was there stays, as it was: no lock left in it
    one_line_error(capsys, ["distill", source, "--target", target, "--output", str(tmp_path / "mine")])
    assert list((tmp_path / "mine").iterdir()) == []


def test_a_lock_file_removed_under_a_waiting_process_is_not_trusted(tmp_path, monkeypatch):
    """A failed run removes its lock file: a process that opened it just before locks a file no longer
    there, and must lock the file now at the path instead (else a third process could lock that one too)."""
    import fcntl

    import headway.locking as locking
    from headway.data.errors import DataError
    from headway.locking import LOCK, output_lock

    folder = tmp_path / "out"
    folder.mkdir()
    (folder / LOCK).write_text("")
    opened = []

    def open_then_lose_it(path, mode):  # the file goes between this process's open and its flock
        f = open(path, mode)
        if not opened:
            Path(path).unlink()
        opened.append(f)
        return f

    monkeypatch.setattr(locking, "open", open_then_lose_it, raising=False)
    with output_lock(folder, DataError):
        assert len(opened) == 2 and (folder / LOCK).read_text() == f"{os.getpid()}\n"
        with open(folder / LOCK) as other:  # what another process would open: locked by us
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


NAMES = {  # a name with nothing local under it -> what the message says (cwd holds probe/ and a file)
    "probe/nope": "no such folder 'probe/nope'",  # probe/ is a folder here: a path, not an org
    "./nope": "no such folder './nope'", "../nope": "no such folder '../nope'", "~/nope-46": "no such folder '~/nope-46'",
    "probe/nope/deeper": "no such folder 'probe/nope/deeper'", "a b/c": "no such folder 'a b/c'",
    "someorg/nope": "no such folder 'someorg/nope', and as a Hub repo id it is not in the local Hub cache "
                    "(HF_HUB_OFFLINE is set: the Hub was not asked)",
    "file.txt": "'file.txt' is a file, not a folder",
}


@pytest.fixture
def probe_cwd(tmp_path, monkeypatch):
    from huggingface_hub import constants

    (tmp_path / "probe").mkdir()
    (tmp_path / "file.txt").write_text("x")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))  # empty: nothing cached
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path


@pytest.mark.parametrize("name", NAMES)
def test_a_missing_heads_folder_is_named_as_such(probe_cwd, target_dir, capsys, name):
    """`--heads probe/nope` was taken for a Hub id: the error spoke of the offline Hub cache. A name
    that can only be a path says "no such folder"; a Hub id says both, in one line."""
    err = one_line_error(capsys, ["generate", "--target", str(target_dir), "--heads", name, "--prompt", "x"])
    assert err == f"headway generate: error: heads checkpoint not found: {NAMES[name]}"


@pytest.mark.parametrize("name", [*NAMES, "nope"])
def test_a_missing_target_folder_is_named_as_such(probe_cwd, heads_dir, capsys, name):
    err = one_line_error(capsys, ["generate", "--target", name, "--heads", str(heads_dir), "--prompt", "x"])
    # a bare name is a Hub model id too (transformers still resolves `gpt2`), unlike a heads repo
    want = NAMES.get(name) or NAMES["someorg/nope"].replace("someorg/nope", "nope")
    assert err == f"headway generate: error: target not found: {want}"


def test_messages_name_a_target_path_as_it_was_given(probe_cwd, heads_dir, capsys):
    """The heads/target hidden-size mismatch printed the target's absolute path; the others the path as given."""
    save_tiny_target(probe_cwd / "wide", "llama", num_hidden_layers=2, hidden_size=32, intermediate_size=64)
    for given in ("wide", "./wide"):
        err = one_line_error(capsys, ["generate", "--target", given, "--heads", str(heads_dir), "--prompt", "x"])
        assert err.endswith(f"but this target has hidden_size=32 ({given})") and str(probe_cwd) not in err
    (probe_cwd / "wide" / "config.json").write_text("{")
    err = one_line_error(capsys, ["generate", "--target", "./wide", "--heads", str(heads_dir), "--prompt", "x"])
    assert err.startswith("headway generate: error: wide/config.json: invalid JSON") and str(probe_cwd) not in err
