"""The transformers cache on a tiny random Llama: same generation as the unquantized cache, every
certificate reported, bad input refused."""

from __future__ import annotations

import pytest
import torch
from counting_aggregator import CountingAggregator, assert_same_counts
from generation import greedy_generate
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig, Qwen2Config, Qwen2ForCausalLM

from witcert.integrations.gating import CachePolicy, GateMode
from witcert.integrations.quality import greedy_continuation, random_model, teacher_forced_quality
from witcert.integrations.telemetry.aggregator import CertificateAggregator
from witcert.integrations.transformers_cache import WitcertCache, cache_kwarg, use_witcert_attention

LAYERS, Q_HEADS, KV_HEADS = 2, 4, 2
# The other architectures' configs at the same size.
TINY = dict(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS, num_attention_heads=Q_HEADS,
    num_key_value_heads=KV_HEADS, max_position_embeddings=256, initializer_range=0.1,
)  # fmt: skip


pytestmark = pytest.mark.usefixtures("reference_kernels")  # conftest.py: the reference path, not the interpreter


@pytest.fixture(scope="module")
def model():
    model = random_model(
        layers=LAYERS, hidden=128, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=32, vocab=256, init_std=0.1
    )
    use_witcert_attention(model)
    return model


def _prompt(batch: int = 1, length: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_generation_matches_unquantized_cache_within_documented_error(model):
    # docs/QUALITY.md: on this model, teacher-forced KL per step < 1e-3 nats and identical greedy argmax.
    prompt = _prompt()
    continuation = greedy_continuation(model, prompt, 12)
    report = teacher_forced_quality(model, prompt, continuation, CachePolicy(mode=GateMode.OBSERVE, seed=0))
    assert report.kl_max < 1e-3
    assert report.top1_agreement == 1.0
    assert report.violations == 0
    assert report.certificates == LAYERS * Q_HEADS * 12

    cache = WitcertCache(model.config, CachePolicy(mode=GateMode.OBSERVE, seed=0), max_cache_len=64)
    generated = greedy_generate(model, prompt, cache, 12)
    assert torch.equal(generated[:, prompt.shape[1] :], continuation)


def test_other_caches_keep_exact_attention(model):
    # With witcert attention installed, a DynamicCache must behave exactly as plain SDPA does.
    prompt = _prompt(seed=2)
    with torch.no_grad():
        ours = model(input_ids=prompt, **{cache_kwarg(model): DynamicCache(config=model.config)}).logits
        model.set_attn_implementation("sdpa")
        plain = model(input_ids=prompt, **{cache_kwarg(model): DynamicCache(config=model.config)}).logits
        use_witcert_attention(model)
    assert torch.equal(ours, plain)


def test_every_layer_head_and_step_is_reported_to_the_aggregator(model):
    batch, steps, stride = 2, 7, 3
    aggregator = CertificateAggregator(LAYERS, Q_HEADS, tau=0.05, stride=stride, device="cpu")
    cache = WitcertCache(model.config, CachePolicy(mode=GateMode.OBSERVE), max_cache_len=64, observer=aggregator)
    greedy_generate(model, _prompt(batch=batch, seed=3), cache, steps + 1, min_new_tokens=steps + 1)
    snapshot = aggregator.snapshot()
    samples = snapshot.samples
    assert snapshot.step == steps
    assert cache.decode_steps == steps
    assert samples.shape == (LAYERS, Q_HEADS)
    assert (samples == batch * steps).all()  # every row of every head of every layer at every step
    assert int(cache.certificate_total) == batch * steps * LAYERS * Q_HEADS
    sampled_steps = sorted(set(snapshot.raw_step.tolist()))
    assert sampled_steps == [s for s in range(steps) if s % stride == 0]
    for step in sampled_steps:
        at_step = snapshot.raw_step == step
        cells = set(zip(snapshot.raw_layer[at_step].tolist(), snapshot.raw_head[at_step].tolist(), strict=True))
        assert cells == {(layer, head) for layer in range(LAYERS) for head in range(Q_HEADS)}


def test_off_mode_reports_nothing_and_keeps_no_backup(model):
    aggregator = CertificateAggregator(LAYERS, Q_HEADS, tau=0.05, stride=1, device="cpu")
    cache = WitcertCache(model.config, CachePolicy(mode=GateMode.OFF), max_cache_len=64, observer=aggregator)
    greedy_generate(model, _prompt(seed=4), cache, 3)
    assert (aggregator.snapshot().counters()["samples"] == 0).all()
    assert cache.backup is None
    assert cache.bytes_per_token < cache.fp16_bytes_per_token / 1.8


def test_chunked_prefill_reads_the_past_from_the_pool(model):
    prompt = _prompt(length=20, seed=5)
    with torch.no_grad():
        whole = model(input_ids=prompt, **{cache_kwarg(model): DynamicCache(config=model.config)}).logits[:, -1]
        cache = WitcertCache(model.config, CachePolicy(mode=GateMode.OBSERVE), max_cache_len=32)
        model(input_ids=prompt[:, :12], **{cache_kwarg(model): cache})
        chunked = model(input_ids=prompt[:, 12:], **{cache_kwarg(model): cache}).logits[:, -1]
    assert cache.get_seq_length() == 20
    kl = (whole.log_softmax(-1).exp() * (whole.log_softmax(-1) - chunked.log_softmax(-1))).sum(-1)
    assert float(kl.max()) < 1e-3


def test_bad_input_is_refused_with_a_clear_error(model):
    with pytest.raises(ValueError, match="max_cache_len"):
        WitcertCache(model.config, max_cache_len=0)
    cache = WitcertCache(model.config, CachePolicy(mode=GateMode.OBSERVE), max_cache_len=8)
    with pytest.raises(ValueError, match="exceeds max_cache_len"), torch.no_grad():
        model(input_ids=_prompt(length=9), **{cache_kwarg(model): cache})
    padded = _prompt(batch=2, length=6, seed=6)
    mask = torch.ones_like(padded)
    mask[0, 0] = 0
    cache = WitcertCache(model.config, CachePolicy(mode=GateMode.OBSERVE), max_cache_len=16)
    with pytest.raises(ValueError, match="unpadded"), torch.no_grad():
        model.generate(
            input_ids=padded, attention_mask=mask, max_new_tokens=2, do_sample=False, **{cache_kwarg(model): cache}
        )
    with pytest.raises(ValueError, match="group_size"), torch.no_grad():
        model(
            input_ids=_prompt(length=4),
            **{cache_kwarg(model): WitcertCache(model.config, CachePolicy(group_size=64), max_cache_len=8)},
        )
    with pytest.raises(ValueError):
        CachePolicy(tau=1.5)


def test_qwen2_style_model_is_certified_too():
    config = Qwen2Config(**TINY)
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(config).eval()  # q/k/v projections with bias, unlike Llama
    use_witcert_attention(qwen)
    prompt = _prompt(seed=8)
    continuation = greedy_continuation(qwen, prompt, 6)
    report = teacher_forced_quality(qwen, prompt, continuation, CachePolicy(mode=GateMode.OBSERVE))
    assert report.certificates == 2 * 4 * 6
    assert report.violations == 0 and report.kl_max < 1e-3


def test_one_aggregator_launch_per_decode_step_with_the_per_layer_counts(model):
    batch, steps, stride = 2, 5, 2
    prompt = _prompt(batch=batch, seed=9)
    observed: list[torch.Tensor] = []
    for mode in (GateMode.OBSERVE, GateMode.GATE):
        # Gate at the median certificate the observe run saw, so that some heads are repaired and some not.
        tau = float(torch.cat(observed).median()) if mode is GateMode.GATE else 0.05
        per_layer = CertificateAggregator(LAYERS, Q_HEADS, tau=tau, stride=stride, device="cpu")

        def audit(cache, layer, query, certificate, sm_scale, per_layer=per_layer, mode=mode):
            # What the cache used to report: one observe call per layer, with the certificate it reports now.
            per_layer.observe(layer, certificate)
            if mode is GateMode.OBSERVE:
                observed.append(certificate.clone())

        aggregator = CountingAggregator(LAYERS, Q_HEADS, tau=tau, stride=stride, device="cpu")
        cache = WitcertCache(
            model.config, CachePolicy(mode=mode, tau=tau), max_cache_len=64, observer=aggregator, audit=audit
        )
        greedy_generate(model, prompt, cache, steps + 1, min_new_tokens=steps + 1)
        assert cache.decode_steps == steps
        assert aggregator.calls == {"observe_layers": steps}  # and no per-layer observe call
        snapshot = aggregator.snapshot()
        # The audit sees no fallbacks: those are checked against the cache's own totals.
        assert_same_counts(snapshot, per_layer.snapshot(), skip=("fallbacks", "repaired_bytes"))
        assert int(snapshot.samples.sum()) == int(cache.certificate_total) == batch * steps * LAYERS * Q_HEADS
        assert int(snapshot.fallbacks.sum()) == int(cache.fallback_total)
        assert int(snapshot.repaired_bytes.sum()) == int(cache.repaired_bytes_total)
        if mode is GateMode.GATE:
            assert 0 < int(cache.fallback_total) < batch * steps * LAYERS * Q_HEADS


def test_a_step_interrupted_before_its_last_layer_is_reported_once(model):
    prompt = _prompt(seed=10)
    tokens = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(11))
    interrupted_steps = {2, 5}  # the last one is interrupted too: only flush_certificates reports it
    per_layer = CertificateAggregator(LAYERS, Q_HEADS, tau=0.05, stride=1, device="cpu")

    def audit(cache, layer, query, certificate, sm_scale):
        if layer == 1 and cache.decode_steps - 1 in interrupted_steps:
            raise RuntimeError("forward interrupted")
        per_layer.observe(layer, certificate)

    aggregator = CountingAggregator(LAYERS, Q_HEADS, tau=0.05, stride=1, device="cpu")
    cache = WitcertCache(
        model.config, CachePolicy(mode=GateMode.OBSERVE), max_cache_len=32, observer=aggregator, audit=audit
    )
    with torch.no_grad():
        model(input_ids=prompt, **{cache_kwarg(model): cache})
        for step in range(tokens.shape[1]):
            if step in interrupted_steps:
                with pytest.raises(RuntimeError, match="interrupted"):
                    model(input_ids=tokens[:, step : step + 1], **{cache_kwarg(model): cache})
            else:
                model(input_ids=tokens[:, step : step + 1], **{cache_kwarg(model): cache})
    # Step 2's first layer went out when step 3 began; step 5's is still pending.
    assert aggregator.calls == {"observe_layers": 5}
    cache.flush_certificates()
    cache.flush_certificates()  # nothing left: no second report
    assert aggregator.calls == {"observe_layers": 6}
    snapshot = aggregator.snapshot()
    assert_same_counts(snapshot, per_layer.snapshot())
    assert snapshot.samples[:, 0].tolist() == [6, 6 - len(interrupted_steps)]


def test_sliding_window_layers_read_their_window_only():
    """Gemma 3's layers attend within a sliding window or over the whole sequence: a decode step reads the window's
    slots alone, so the witcert run follows the unquantized one, which attends within the window too."""
    config = Gemma3TextConfig(
        **TINY, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    gemma = Gemma3ForCausalLM(config).eval()
    use_witcert_attention(gemma)
    prompt = _prompt(seed=10)  # 24 tokens: three windows
    continuation = greedy_continuation(gemma, prompt, 6)
    report = teacher_forced_quality(gemma, prompt, continuation, CachePolicy(mode=GateMode.OBSERVE))
    assert report.certificates == 2 * 4 * 6
    assert report.violations == 0 and report.kl_max < 1e-3 and report.top1_agreement == 1.0

    cache = WitcertCache(config, CachePolicy(mode=GateMode.OBSERVE), max_cache_len=32, keep_exact=True)
    greedy_generate(gemma, prompt, cache, 3)
    length = cache.layers[0].length
    assert length > 8 and cache.visible(0) == (length - 8, length) and cache.visible(1) == (0, length)
    assert cache.keys_read(0, 0).shape[0] == 8 and cache.exact_keys(0, 0).shape[0] == 8
    assert cache.keys_read(1, 0).shape[0] == length


def test_an_attention_kind_the_cache_does_not_implement_is_refused():
    config = Gemma3TextConfig(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match="layer 0's attention is 'chunked_attention'"):
        WitcertCache(config, max_cache_len=8)
