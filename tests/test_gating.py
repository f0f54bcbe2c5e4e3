"""Gating (THEORY.md section 5): every certificate ends <= tau, and only what must be repaired is."""

from __future__ import annotations

import math

import pytest
import torch
from generation import greedy_generate

from witcert.integrations.aggregator import CertificateAggregator
from witcert.integrations.gating import CachePolicy, GateMode, block_shares, certified_decode
from witcert.integrations.quality import random_model
from witcert.integrations.transformers_cache import WitcertCache, use_witcert_attention
from witcert.kernels import reference

H_Q, H_KV, D, S, BLOCK = 4, 2, 64, 96, 16
SM_SCALE = D**-0.5
DELTA = reference.delta_step(28, H_Q)


pytestmark = pytest.mark.usefixtures("reference_kernels")  # conftest.py: the reference path, not the interpreter


def _head_inputs(seed: int = 0, sharpness: float = 3.0):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(S, H_KV, D, generator=generator).to(torch.float16)
    values = torch.randn(S, H_KV, D, generator=generator).to(torch.float16)
    q = sharpness * torch.randn(H_Q, D, generator=generator)
    slots = torch.arange(S)
    k_quant = reference.quantize(keys, seed=seed, layer=0, slots=slots, kind="k", dither_bits=8)
    v_hat = reference.quantize(values, seed=seed, layer=0, slots=slots, kind="v", dither_bits=8).dequantize()
    return q, keys, values, k_quant, v_hat


class _Backup:
    """Exact rows of one sequence, counting every row it hands out."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values
        self.fetched: list[tuple[int, list[int]]] = []

    def __call__(self, positions: torch.Tensor, kv_head: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.fetched.append((kv_head, positions.tolist()))
        return self.keys[positions, kv_head], self.values[positions, kv_head]


def _decode(q, k_quant, v_hat, backup, tau, exact=None):
    mask, exact_k, exact_v = exact or (
        torch.zeros(S, H_KV, dtype=torch.bool),
        torch.zeros(S, H_KV, D),
        torch.zeros(S, H_KV, D),
    )
    result = certified_decode(
        q,
        k_quant,
        v_hat,
        mask,
        exact_k,
        exact_v,
        sm_scale=SM_SCALE,
        delta=DELTA,
        tau=tau,
        fetch=backup if tau is not None else None,
        block_size=BLOCK,
    )
    return result, (mask, exact_k, exact_v)


def test_block_shares_sum_to_t1():
    q, keys, values, k_quant, v_hat = _head_inputs()
    observed, _ = _decode(q, k_quant, v_hat, None, None)
    kv_of_q = torch.arange(H_Q) // (H_Q // H_KV)
    radius = reference.logit_radius(q, k_quant, sm_scale=SM_SCALE, delta=DELTA, kv_head_of_query=kv_of_q)
    probs = torch.softmax(SM_SCALE * torch.einsum("hd,shd->hs", q, k_quant.dequantize()[:, kv_of_q]), dim=-1)
    t1 = reference.accumulate_certificate(probs, radius).terms.t1
    blocks = torch.arange(S) // BLOCK
    for head in range(H_Q):
        shares = block_shares(probs[head], radius[head], blocks, S // BLOCK)
        assert float(shares.sum()) == pytest.approx(float(t1[head]), rel=1e-5)
    assert block_shares(torch.tensor([0.0, 1.0]), torch.tensor([1e4, 0.0]), torch.tensor([0, 1]), 2)[0] == math.inf


def test_gate_stops_at_tau_pages_by_share_and_is_minimal():
    q, keys, values, k_quant, v_hat = _head_inputs(sharpness=4.0)
    observed, _ = _decode(q, k_quant, v_hat, None, None)
    tau = float(observed.certificate.min()) / 3  # every head must be repaired
    backup = _Backup(keys, values)
    gated, (mask, exact_k, exact_v) = _decode(q, k_quant, v_hat, backup, tau)
    assert bool((gated.certificate <= tau).all())
    assert bool(gated.fallback.any())
    assert not torch.equal(mask, torch.ones_like(mask))  # stopped before paging in everything
    # Bytes: K and V rows in fp16, for exactly the rows fetched.
    rows = sum(len(positions) for _, positions in backup.fetched)
    assert int(gated.repaired_bytes.sum()) == rows * D * 2 * 2
    # The first block paged in is the largest share of the first repaired head's bound.
    kv_of_q = torch.arange(H_Q) // (H_Q // H_KV)
    first_head = int(gated.fallback.nonzero()[0])
    radius = reference.logit_radius(q, k_quant, sm_scale=SM_SCALE, delta=DELTA, kv_head_of_query=kv_of_q)
    probs = torch.softmax(SM_SCALE * torch.einsum("hd,shd->hs", q, k_quant.dequantize()[:, kv_of_q]), dim=-1)
    shares = block_shares(probs[first_head], radius[first_head], torch.arange(S) // BLOCK, S // BLOCK)
    assert backup.fetched[0] == (
        int(kv_of_q[first_head]),
        list(range(int(shares.argmax()) * BLOCK, (int(shares.argmax()) + 1) * BLOCK)),
    )
    # Minimal: without the last block paged in, some head would still be above tau.
    last_head, last_positions = backup.fetched[-1]
    without_last = mask.clone()
    without_last[last_positions, last_head] = False
    replay, _ = _decode(q, k_quant, v_hat, None, None, exact=(without_last, exact_k, exact_v))
    assert bool((replay.certificate > tau).any())


def test_repaired_slots_are_never_paid_twice():
    q, keys, values, k_quant, v_hat = _head_inputs(seed=3, sharpness=4.0)
    observed, _ = _decode(q, k_quant, v_hat, None, None)
    tau = float(observed.certificate.max()) / 2
    backup = _Backup(keys, values)
    first, exact = _decode(q, k_quant, v_hat, backup, tau)
    fetched_once = list(backup.fetched)
    second, _ = _decode(q, k_quant, v_hat, backup, tau, exact=exact)  # the next step, same query
    assert backup.fetched == fetched_once  # nothing paged in again
    assert not bool(second.fallback.any()) and int(second.repaired_bytes.sum()) == 0
    assert torch.allclose(second.certificate, first.certificate)


def test_gate_mode_on_a_model_drives_every_certificate_below_tau():
    model = random_model(layers=2, hidden=128, q_heads=4, kv_heads=2, head_dim=32, vocab=256, init_std=0.15)
    use_witcert_attention(model)
    prompt = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    steps = 6
    certificates: dict[str, list[torch.Tensor]] = {"observe": [], "gate": []}
    counts = {}
    for mode in ("observe", "gate"):
        recorded = certificates[mode]

        def audit(cache, layer, query, certificate, sm_scale, recorded=recorded):
            recorded.append(certificate.clone())

        # Gate at the median certificate the observe run saw: about half the head-steps need repair.
        tau = float(torch.cat(certificates["observe"]).median()) if mode == "gate" else 0.5
        aggregator = CertificateAggregator(2, 4, tau=tau, stride=1, device="cpu")
        cache = WitcertCache(
            model.config, CachePolicy(mode=mode, tau=tau), max_cache_len=64, observer=aggregator, audit=audit
        )
        greedy_generate(model, prompt, cache, steps + 1, min_new_tokens=steps + 1)
        counts[mode] = (aggregator.snapshot(), cache, tau)
    gate_snapshot, gate_cache, tau = counts["gate"]
    gated = torch.cat(certificates["gate"])
    assert bool((gated <= tau).all())
    assert (gate_snapshot.covered == gate_snapshot.samples).all()
    # Half the observed certificates exceeded tau, so repairs happened; the rest needed none.
    assert 0 < int(gate_cache.fallback_total) <= gated.numel()
    assert int(gate_snapshot.fallbacks.sum()) == int(gate_cache.fallback_total)
    assert int(gate_snapshot.repaired_bytes.sum()) == int(gate_cache.repaired_bytes_total) > 0
    observe_snapshot, observe_cache, _ = counts["observe"]
    assert int(observe_snapshot.fallbacks.sum()) == 0 and observe_cache.backup is None


def test_a_tau_above_every_certificate_repairs_nothing():
    q, keys, values, k_quant, v_hat = _head_inputs(seed=5)
    observed, _ = _decode(q, k_quant, v_hat, None, None)
    backup = _Backup(keys, values)
    gated, _ = _decode(q, k_quant, v_hat, backup, float(observed.certificate.max()) * 1.01)
    assert backup.fetched == []
    assert torch.equal(gated.certificate, observed.certificate)
    assert torch.allclose(gated.out, observed.out)


def test_policy_rejects_bad_knobs():
    for bad in (
        {"tau": 0.0},
        {"tau": 1.0},
        {"dither_bits": 12},
        {"repair_block": 0},
        {"mode": "sometimes"},
        {"unknown": 1},
    ):
        with pytest.raises(ValueError):
            CachePolicy(**bad)
    assert CachePolicy(mode="gate").mode is GateMode.GATE
