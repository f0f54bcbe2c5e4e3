"""The transformers cache on the H200: the fused kernels in the loop of a larger random-init model."""

from __future__ import annotations

import pytest
import torch
from generation import greedy_generate

from witcert.integrations.gating import CachePolicy, GateMode
from witcert.integrations.quality import HeadAudit, greedy_continuation, random_model, teacher_forced_quality
from witcert.integrations.telemetry import CertificateAggregator
from witcert.integrations.transformers_cache import WitcertCache, cache_kwarg, use_witcert_attention
from witcert.kernels import reference

pytestmark = pytest.mark.gpu

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM = 4, 16, 4, 128


@pytest.fixture(scope="module")
def model():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = random_model(
        layers=LAYERS,
        hidden=Q_HEADS * HEAD_DIM,
        q_heads=Q_HEADS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        vocab=4096,
        dtype=torch.float16,
        device="cuda",
    )
    use_witcert_attention(model)
    return model


def _prompt(batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, 4096, (batch, length), generator=torch.Generator().manual_seed(0)).cuda()


def test_kernel_decode_matches_the_reference_inside_the_model(model):
    cache = WitcertCache(model.config, CachePolicy(mode=GateMode.OBSERVE), max_cache_len=600)
    decode = cache.decode
    worst = {"out": 0.0}

    def checked(layer, query, sm_scale):
        out = decode(layer, query, sm_scale)
        for b in range(query.shape[0]):
            slots = cache.slots(b, cache.layers[layer].length)
            expected = reference.decode_attention(
                query[b].half().float(),
                cache.pool.quantized(layer, slots, "k"),
                cache.pool.quantized(layer, slots, "v"),
                sm_scale=sm_scale,
                delta_step=cache.delta,
            )
            worst["out"] = max(worst["out"], float((out[b] - expected.out).abs().max()))
        return out

    cache.decode = checked
    prompt = _prompt(2, 512)
    greedy_generate(model, prompt, cache, 5)
    assert worst["out"] < 2e-3


def test_teacher_forced_quality_and_gating_on_gpu(model):
    prompt = _prompt(1, 512)
    continuation = greedy_continuation(model, prompt, 8)
    observed = teacher_forced_quality(model, prompt, continuation, CachePolicy(mode=GateMode.OBSERVE, seed=0))
    assert observed.violations == 0
    assert observed.certificates == LAYERS * Q_HEADS * 8
    tau = observed.median_certificate
    audit = HeadAudit()
    aggregator = CertificateAggregator(LAYERS, Q_HEADS, tau=tau, stride=1, device="cuda")
    cache = WitcertCache(
        model.config,
        CachePolicy(mode=GateMode.GATE, tau=tau, seed=0),
        max_cache_len=530,
        observer=aggregator,
        audit=audit,
    )
    with torch.no_grad():
        model(input_ids=prompt, **{cache_kwarg(model): cache})
        for t in range(8):
            model(input_ids=continuation[:, t : t + 1], **{cache_kwarg(model): cache})
    certificates = torch.stack(audit.certificate)
    assert bool((certificates <= tau).all())
    assert int((torch.stack(audit.true_tv) > certificates).sum()) == 0
    snapshot = aggregator.snapshot()
    assert int(snapshot.fallbacks.sum()) == int(cache.fallback_total) > 0
    assert int(snapshot.repaired_bytes.sum()) == int(cache.repaired_bytes_total)
    assert (snapshot.covered == snapshot.samples).all()
