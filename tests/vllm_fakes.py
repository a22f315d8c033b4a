"""Stand-ins for vLLM in tests (CI has none): its metrics reader, with vLLM's class names and fields."""

from pathlib import Path

READER = '''
from dataclasses import dataclass


@dataclass
class Metric:
    name: str
    labels: dict


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Vector(Metric):
    values: list


@dataclass
class Gauge(Metric):
    value: float
'''


def write_vllm_package(root: Path, init: str = "") -> Path:
    """A ``vllm`` package under ``root`` (``init`` its ``__init__.py``) with ``vllm.v1.metrics.reader``."""
    pkg = root / "vllm"
    (pkg / "v1" / "metrics").mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(init)
    for sub in ("v1", "v1/metrics"):
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "v1" / "metrics" / "reader.py").write_text(READER)
    return root
