import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from headway.testing import ARCHITECTURES, save_tiny_target, tiny_target  # noqa: E402

# Tiny models are overhead-bound: one thread is faster, and much faster on a busy machine.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def target_dirs(tmp_path_factory):
    """A saved tiny random target (HF folder with tokenizer) per fixture architecture."""
    root = tmp_path_factory.mktemp("targets")
    return {arch: save_tiny_target(root / arch, arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def llama_dir(target_dirs):
    return target_dirs["llama"]


@pytest.fixture
def tiny_llama():
    return tiny_target("llama")


@pytest.fixture
def one_thread():
    """Two threads on a shared 2-core machine oversubscribe badly; tiny models need one."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session", autouse=True)
def native_kernel_built():
    """Build headway's native kernel (cached per machine) before any test runs: a first build inside
    a CLI test's subprocess, some of which time out after 2 minutes, would count against that test."""
    from headway import native

    native.native_kernel()
