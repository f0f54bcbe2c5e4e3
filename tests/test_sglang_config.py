"""The SGLang plugin's settings and its ``witcert sglang-config`` command; neither needs SGLang installed."""

from __future__ import annotations

import json

import pytest

from witcert.cli import main
from witcert.integrations.sglang.config import ConfigError, load_settings


def test_settings_parse_every_variable_and_name_the_bad_one():
    settings = load_settings(
        {"WITCERT_MODE": "gate", "WITCERT_TAU": "0.1", "WITCERT_OUTLIER_PAIRS": "2", "WITCERT_V_DITHER": "false"}
    )
    assert (settings.mode.value, settings.tau, settings.outlier_pairs, settings.v_dither) == ("gate", 0.1, 2, False)
    assert settings.policy().tau == 0.1 and settings.collector_endpoint is None
    with pytest.raises(ConfigError, match="WITCERT_TAUU"):
        load_settings({"WITCERT_TAUU": "0.1"})
    with pytest.raises(ConfigError, match="WITCERT_TAU='1.5'"):
        load_settings({"WITCERT_TAU": "1.5"})
    with pytest.raises(ConfigError, match="WITCERT_DITHER_BITS='7'"):
        load_settings({"WITCERT_DITHER_BITS": "7"})
    with pytest.raises(ConfigError, match="WITCERT_COLLECTOR_ENDPOINT"):
        load_settings({"WITCERT_COLLECTOR_ENDPOINT": "not a url"})


def test_sglang_config_reports_settings_and_capacity(tmp_path, monkeypatch, capsys):
    # A Llama-3-8B-shaped config: 32 layers, 8 KV heads of 128 channels; 2 ranks hold 4 KV heads each.
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096})
    )
    monkeypatch.setenv("WITCERT_OUTLIER_PAIRS", "2")
    assert main(["sglang-config", "--model-config", str(tmp_path), "--tp-size", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    fp16, ours = 32 * 2 * 4 * 128 * 2, 32 * 2 * 4 * (128 + 2 * 128 // 32 + 2 * 2 * 2)
    assert f"fp16 {fp16}, witcert {ours}: {fp16 / ours:.3f}x" in out
    assert "WITCERT_OUTLIER_PAIRS │ 2 │ environment" in out and "--attention-backend witcert" in out


def test_sglang_config_refuses_a_bad_variable(monkeypatch, capsys):
    monkeypatch.setenv("WITCERT_MODEE", "gate")
    assert main(["sglang-config"]) == 2
    assert "unknown witcert setting(s) WITCERT_MODEE" in capsys.readouterr().err
