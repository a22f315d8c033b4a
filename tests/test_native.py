"""headway.native: the native few-row linear equals F.linear at every row count and shape, runs
only where it fits, is picked by the probe where it is fastest, is refused by name where it cannot
be built, and keeps tree decoding exact."""

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_decode_exact import OracleProposer, make_heads, prompts, reference
from torch import nn

from headway import kernels, native
from headway.decode import Speculator
from headway.decode.proposers import make_proposer
from headway.kernels import BUCKETS, LinearKernels, LinearPlan, plain_linears, probe_plan
from headway.testing import tiny_target

# on the machines CI runs on (x86-64 Linux with a C++ compiler) the kernel must build: a skip there
# would hide a broken build
BUILDABLE = platform.system() == "Linux" and bool(shutil.which("c++") or shutil.which("g++"))


@pytest.fixture(scope="module")
def built():
    ok, why = native.native_kernel()
    if not ok and not BUILDABLE:
        pytest.skip(f"no native kernel here: {why}")
    assert ok, why


# 1-8 rows: one tile pass with AVX-512 (7-8 rows: 3 weight rows a tile, 70 % 3 = 1 left), else chunks that
# stream the weights; more: register tiles of 6 rows (9 = 6 + 3, 12 = 6 + 6, 48 = 8 tiles) over blocks of 4
# weight rows in tasks of 32 (out 70: two tasks and a partial one, 70 % 4 = 2 left)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 24, 33, 48])
@pytest.mark.parametrize("dims", [(576, 40), (24, 7), (37, 33), (96, 70)])  # in/out: multiples of 16 or not
def test_native_equals_f_linear(built, rows, dims):
    torch.manual_seed(rows)
    k, o = dims
    x, w = torch.randn(rows, k), torch.randn(o, k)
    got = native.native_linear(x, w)
    assert got.shape == (rows, o) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-4, atol=1e-4)


def test_native_runs_on_torchs_threads(built):
    """The kernel's parallel loop uses torch's intra-op threads: built without the parallel backend's
    flags it ran on one thread whatever the count (half the speed of 8-64-row verifies on 2 cores)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert native.parallel_width(64) == 2
        torch.set_num_threads(1)
        assert native.parallel_width(64) == 1
    finally:
        torch.set_num_threads(threads)


def test_flags_follow_the_cpu(monkeypatch):
    """AVX2/FMA on an AVX2 x86 CPU, + AVX-512 where it has it (the many-row tiles' 16-float vectors);
    the flags are part of the build's cache tag, so an AVX2 machine sharing the cache builds its own."""
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    for capability, expect in [("AVX512", ["-mavx2", "-mfma", "-mavx512f"]), ("AVX2", ["-mavx2", "-mfma"]),
                               ("DEFAULT", [])]:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        flags, _ = native._flags()
        assert [f for f in flags if f.startswith("-m")] == expect, capability
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert not [f for f in native._flags()[0] if f.startswith("-m")]


@pytest.mark.parametrize("shape", [(1, 1, 24), (2, 5, 24), (3, 24)])
def test_native_with_bias_and_batch_dims(built, shape):
    torch.manual_seed(0)
    lin = nn.Linear(24, 40)
    x = torch.randn(shape)
    torch.testing.assert_close(native.native_linear(x, lin.weight, lin.bias), F.linear(x, lin.weight, lin.bias),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 17])
@pytest.mark.parametrize("dims", [(576, 40), (37, 33), (96, 70)])
def test_native_with_bfloat16_weights_equals_f_linear_in_float32(built, rows, dims):
    """A bf16 weight is widened as it is read: the product is F.linear's over the same (exactly
    representable) values in float32, rounded to the input's dtype."""
    torch.manual_seed(rows)
    k, o = dims
    x, w, b = torch.randn(rows, k).bfloat16(), torch.randn(o, k).bfloat16(), torch.randn(o).bfloat16()
    want = F.linear(x.float(), w.float())
    torch.testing.assert_close(native._build()[0].fewrow(x.float(), w), want, rtol=1e-4, atol=1e-4)  # float32 x
    got = native.native_linear(x, w, b)  # bf16 x: computed in float32, rounded once, then the bias
    assert got.dtype == torch.bfloat16 and got.shape == (rows, o)
    torch.testing.assert_close(got.float(), want + b.float(), rtol=2e-2, atol=5e-2)  # two bf16 roundings


def test_fits_float32_or_bfloat16_cpu_contiguous_without_grad():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    assert native.fits(x, w)
    assert native.fits(x.bfloat16(), w.bfloat16())
    assert not native.fits(x.half(), w.half())
    assert not native.fits(x, w.bfloat16())  # mixed dtypes: F.linear would refuse them too
    assert not native.fits(x, torch.randn(8, 4).t())  # a transposed view: not contiguous
    assert not native.fits(x, w.requires_grad_())  # training: no backward here
    with torch.no_grad():
        assert native.fits(x, w)


def test_plan_runs_native_where_it_says_and_stock_where_it_does_not_fit(built, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    calls = []
    real = native.native_linear
    monkeypatch.setattr(native, "native_linear", lambda x, w, b=None: calls.append(x.shape[-2]) or real(x, w, b))
    x = torch.randn(1, 5, 16)
    want = {n: model(x[:, :n]) for n in (1, 3, 5)}
    plan = LinearPlan(("stock", "native", "weight-major", "native", "stock"))
    with torch.no_grad(), kernels.weight_major(plain_linears(model), plan):
        for n in (1, 3, 5):
            torch.testing.assert_close(model(x[:, :n]), want[n], rtol=1e-5, atol=1e-6)
        assert calls == [5, 5]  # 5 rows: native (both linears); 1: stock, 3: weight-major
        model.bfloat16()
        model(x[:, :5].bfloat16())
        assert calls == [5, 5, 5, 5]  # bf16 weights run native too
        model.half()
        model(x[:, :5].half())
        assert calls == [5, 5, 5, 5]  # fp16 weights run stock


def test_probe_picks_native_where_it_is_fastest(monkeypatch):
    """Fake clock: native wins at 1, 4, 8, 12, 24 and 32 rows; weight-major at 2; stock at 16, 48 and
    64 (native within the margin); the same for bf16 weights. Without native (an fp16 target, or no
    build) the same clock gives weight-major or stock."""
    cost = {"stock": {1: 1.0, 2: 2.0, 4: 2.0, 8: 2.0, 12: 3.0, 16: 4.0, 24: 6.0, 32: 8.0, 48: 12.0, 64: 16.0},
            "weight-major": {2: 0.9, 3: 1.5, 4: 1.5, 5: 2.0, 6: 2.0, 7: 2.0, 8: 1.5, 12: 3.0, 16: 4.0, 24: 6.0,
                             32: 8.0, 48: 12.0, 64: 16.0},
            "native": {1: 0.8, 2: 1.0, 4: 1.0, 8: 1.2, 12: 2.0, 16: 3.9, 24: 5.0, 32: 6.0, 48: 11.9, 64: 15.5}}
    timed = []
    monkeypatch.setattr(kernels, "_time", lambda linears, rows, kernel: timed.append((kernel, rows))
                        or cost[kernel][rows])
    plan = probe_plan([nn.Linear(4, 4)], margin=0.05, with_native=True)
    assert plan.kernels == ("native", "weight-major", "native", "native", "native", "stock", "native", "native",
                            "stock", "stock")
    assert plan.describe() == "native at 1, 3-4, 5-8, 9-12, 17-24, 25-32 rows; weight-major at 2 rows"
    assert len(timed) == 3 + 2 * (23 + 10)  # warm-ups, then 10 stock, 13 weight-major and 10 native passes, twice
    assert probe_plan([nn.Linear(4, 4)], with_native=False).kernels == \
        ("weight-major",) * 4 + ("stock",) * 6  # 1 row runs as 2 columns
    monkeypatch.setattr(native, "native_kernel", lambda: (True, ""))
    assert probe_plan([nn.Linear(4, 4).bfloat16()]).kernels == plan.kernels  # bf16 weights: native timed too
    monkeypatch.setattr(native, "native_kernel", lambda: pytest.fail("an fp16 model must not build or time it"))
    assert "native" not in probe_plan([nn.Linear(4, 4).half()]).kernels


def test_native_by_name_is_refused_where_it_cannot_be_built(monkeypatch):
    monkeypatch.setattr(native, "_build", lambda: (None, "CalledProcessError: no compiler"))
    with pytest.raises(native.NativeKernelError, match=r"cannot be built here \(CalledProcessError: no compiler\)"):
        LinearKernels("native", nn.Linear(4, 4))
    assert native.native_kernel() == (False, "CalledProcessError: no compiler")


def test_the_environment_variable_turns_it_off(monkeypatch):
    monkeypatch.setenv(native.ENV, "0")
    native._build.cache_clear()
    try:
        assert native.native_kernel() == (False, f"disabled by {native.ENV}=0")
    finally:
        native._build.cache_clear()


def test_a_compiler_without_openmp_still_gets_the_serial_kernel(monkeypatch):
    """-fopenmp fails to build (a compiler without OpenMP): the kernel is built again without it."""
    import torch.utils.cpp_extension as ext

    builds = []

    def load(name, sources, extra_cflags, extra_ldflags, verbose):
        builds.append(list(extra_cflags))
        if "-fopenmp" in extra_cflags:
            raise RuntimeError("Error building extension\nclang: error: unsupported option '-fopenmp'")
        return "serial module"

    monkeypatch.setattr(ext, "load", load)
    monkeypatch.setattr(native, "_flags", lambda: (["-O3", "-fopenmp"], ["-fopenmp"]))
    monkeypatch.setattr(native, "_cached", lambda name: True)
    monkeypatch.delenv(native.ENV, raising=False)
    native._build.cache_clear()
    try:
        assert native._build() == ("serial module", "")
        assert builds == [["-O3", "-fopenmp"], ["-O3"]]
        monkeypatch.setattr(native, "_flags", lambda: (["-O3"], []))
        native._build.cache_clear()
        builds.clear()
        monkeypatch.setattr(ext, "load", lambda **kw: builds.append(kw) or (_ for _ in ()).throw(OSError("no c++")))
        assert native._build() == (None, "OSError: no c++")  # without -fopenmp there is nothing to retry
        assert len(builds) == 1
    finally:
        native._build.cache_clear()


@pytest.mark.parametrize("kind, tree", [("eagle3", "chain-3"), ("medusa", "chain-3"),
                                        ("eagle3", "dynamic-4-4-16")])  # 16 verify rows: the register tiles
def test_tree_decoding_stays_exact_with_native_linears(built, kind, tree):
    model, tok = tiny_target("llama")
    spec = Speculator(model, tok, make_heads(kind, model), tree=tree, linear_kernel="native")
    assert spec.kernels.plan().kernels == ("native",) * len(BUCKETS)
    for p in prompts(tok, n=4):
        ref = reference(model, p, 16)
        spec.new_proposer = lambda: OracleProposer(make_proposer(spec.heads), ref, len(p), model.config.vocab_size)
        assert spec.generate(p, max_new_tokens=16).ids == ref


def test_no_compiler_is_one_line_and_auto_goes_on_with_stock_kernels(monkeypatch, capsys):
    """torch's extension builder unimportable (as where no toolchain is installed): one line on stderr
    saying what to install, once per process, and ``auto`` plans without the native kernel."""
    monkeypatch.setitem(__import__("sys").modules, "torch.utils.cpp_extension", None)
    monkeypatch.delenv(native.ENV, raising=False)
    native._build.cache_clear()
    try:
        ok, why = native.native_kernel()
        assert not ok and "ModuleNotFoundError" in why
        assert native.native_kernel() == (False, why)
        plan = kernels.probe_plan([nn.Linear(4, 4)], reps=1)
        assert "native" not in plan.kernels
        lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert len(lines) == 1 and "install a C++ compiler" in lines[0] and why in lines[0]
    finally:
        native._build.cache_clear()


def test_a_baton_left_by_a_killed_build_is_cleared(tmp_path, monkeypatch):
    """A build killed mid-way leaves torch's ``lock`` file; without headway's lock every later build waits
    on it forever (a CI run hung in every test's setup this way)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory("headway_probe", verbose=False))
    (folder / "lock").touch()
    with native.build_lock("headway_probe"):
        assert not (folder / "lock").exists()
    assert folder.is_dir()


def test_the_kernel_loads_past_a_stale_baton_in_a_fresh_process(built, tmp_path):
    """The cached build copied beside a stale baton: a new process loads it instead of hanging."""
    cached = Path(native._build()[0].__file__).parent.parent  # torch's cache, where the built kernel lies
    for folder in [p for p in cached.glob("headway_fewrow_*") if any(p.glob("*.so"))]:
        shutil.copytree(folder, tmp_path / "py" / folder.name)
        (tmp_path / "py" / folder.name / "lock").touch()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "py")}
    run = subprocess.run([sys.executable, "-c", "from headway import native; print(native.native_kernel())"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "(True, '')" in run.stdout
    assert "left by a native-kernel build that was killed" in run.stderr
