"""bf16 only where it is fast: the measured probe, its override, and the three places that use it
(demo target presets, training's mixed_precision=auto, distill's dtype=auto)."""

import pytest

from headway.hardware import ENV, FAST, bf16_is_fast, cpu_bf16_is_fast, cpu_bf16_speedup


def test_the_probe_measures_a_ratio():
    ratio = cpu_bf16_speedup()
    assert ratio > 0 and ratio == cpu_bf16_speedup()  # measured once per process


@pytest.mark.parametrize("value, fast", [("1", True), ("on", True), ("0", False), ("off", False)])
def test_the_environment_forces_the_answer(monkeypatch, value, fast):
    monkeypatch.setenv(ENV, value)
    assert cpu_bf16_is_fast() is fast and bf16_is_fast("cpu") is fast


def test_without_a_forced_answer_the_measurement_decides(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert cpu_bf16_is_fast() is (cpu_bf16_speedup() >= FAST)


def test_an_even_race_keeps_float32(monkeypatch):
    """Where bf16 and fp32 run about even the probe's noise must not pick the dtype (a resumed job
    would meet shards of the other one): bf16 only when clearly faster."""
    from headway import hardware

    monkeypatch.delenv(ENV, raising=False)
    for ratio, fast in ((1.05, False), (1.19, False), (FAST, True), (1.8, True), (0.3, False)):
        monkeypatch.setattr(hardware, "cpu_bf16_speedup", lambda r=ratio: r)
        assert hardware.cpu_bf16_is_fast() is fast, ratio


@pytest.mark.parametrize("fast", [True, False])
def test_a_presets_bf16_follows_the_cpu_and_an_explicit_one_stays(monkeypatch, tmp_path, fast):
    from headway.demo.builder import cache_key, resolve_config
    from headway.demo.configs import TargetBuildConfig

    monkeypatch.setenv(ENV, "1" if fast else "0")
    preset = resolve_config(TargetBuildConfig(preset="demo", cache_dir=str(tmp_path)))
    assert preset.bf16 is fast
    assert resolve_config(TargetBuildConfig(preset="demo", bf16=True, cache_dir=str(tmp_path))).bf16 is True
    assert resolve_config(TargetBuildConfig(preset="tiny", cache_dir=str(tmp_path))).bf16 is False  # fp32 preset
    # the cache key names what was trained: fp32 and bf16 builds never stand in for each other
    explicit = TargetBuildConfig(preset="demo", bf16=not fast, cache_dir=str(tmp_path))
    assert cache_key(TargetBuildConfig(preset="demo", cache_dir=str(tmp_path))) != cache_key(explicit)


@pytest.mark.parametrize("fast, expected", [(True, "bf16"), (False, "no")])
def test_training_auto_precision_takes_bf16_only_where_fast(monkeypatch, tmp_path, fast, expected):
    from headway.train.config import TrainConfig
    from headway.train.accel import make_accelerator

    monkeypatch.setenv(ENV, "1" if fast else "0")
    acc = make_accelerator(TrainConfig(kind="medusa", target="t", output_dir=str(tmp_path), mixed_precision="auto",
                                       device="cpu", report_to="none"))
    assert acc.mixed_precision == expected


def test_training_bf16_on_a_slow_cpu_warns_and_keeps_the_choice(monkeypatch, tmp_path, capsys):
    from headway.train.config import TrainConfig
    from headway.train.accel import make_accelerator

    monkeypatch.setenv(ENV, "0")
    acc = make_accelerator(TrainConfig(kind="medusa", target="t", output_dir=str(tmp_path), mixed_precision="bf16",
                                       device="cpu", report_to="none"))
    assert acc.mixed_precision == "bf16"
    err = capsys.readouterr().err
    assert "without fast bf16 matmul" in err and "mixed_precision=auto" in err


@pytest.mark.parametrize("fast", [True, False])
def test_distill_auto_dtype_on_cpu_follows_the_measurement(monkeypatch, fast):
    from headway.data.distill import generation_dtype

    monkeypatch.setenv(ENV, "1" if fast else "0")
    assert generation_dtype("auto", "cpu") == ("bfloat16" if fast else "float32")
    assert generation_dtype("float32", "cpu") == "float32" and generation_dtype("bfloat16", "cpu") == "bfloat16"


def test_the_probe_leaves_the_global_rng_alone():
    import torch

    cpu_bf16_speedup.cache_clear()
    torch.manual_seed(3)
    state = torch.get_rng_state()
    cpu_bf16_speedup()
    assert torch.equal(torch.get_rng_state(), state)
