"""Gating (THEORY.md section 6): every certificate ends <= tau, only what must be repaired is, and repaired
pairs are read exactly through the kernel + merge path afterwards."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from generation import greedy_generate
from transformers import LlamaConfig

from witcert.integrations import gating
from witcert.integrations.gating import (
    CachePolicy,
    CertifiedDecode,
    DecodePaging,
    ExactPart,
    GateMode,
    RepairedStore,
    block_shares,
    certified_decode_rows,
    exact_attention,
    merge_exact,
)
from witcert.integrations.quality import random_model
from witcert.integrations.telemetry.aggregator import CertificateAggregator
from witcert.integrations.telemetry.step_report import StepReport
from witcert.integrations.transformers_cache import WitcertCache, use_witcert_attention
from witcert.kernels import KVPool, decode_attention, reference

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
        self.fetched: list[list[tuple[int, int]]] = []  # one list of (position, kv_head) pairs per call

    def __call__(self, positions: torch.Tensor, kv_heads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.fetched.append(list(zip(positions.tolist(), kv_heads.tolist(), strict=True)))
        return self.keys[positions, kv_heads], self.values[positions, kv_heads]

    def blocks(self, call: int, block: int = BLOCK) -> dict[int, set[int]]:
        """The blocks of each KV head paged in by one call."""
        paged: dict[int, set[int]] = {}
        for position, kv_head in self.fetched[call]:
            paged.setdefault(kv_head, set()).add(position // block)
        return paged


def _decode(q, k_quant, v_hat, backup, tau, exact=None, block=BLOCK):
    """``certified_decode_rows`` on a batch of one row; returns row 0's out, certificate, fallback, bytes."""
    mask, exact_k, exact_v = exact or (
        torch.zeros(S, H_KV, dtype=torch.bool),
        torch.zeros(S, H_KV, D),
        torch.zeros(S, H_KV, D),
    )
    result = certified_decode_rows(
        q[None],
        [k_quant],
        v_hat[None],
        mask[None],
        exact_k[None],
        exact_v[None],
        sm_scale=SM_SCALE,
        delta=DELTA,
        tau=tau,
        fetch=None if tau is None else (lambda rows, positions, kv_heads: backup(positions, kv_heads)),
        block_size=block,
    )
    row = SimpleNamespace(
        out=result.out[0], certificate=result.certificate[0], fallback=result.fallback[0],
        repaired_bytes=result.repaired_bytes[0],
    )  # fmt: skip
    return row, (mask, exact_k, exact_v)


def test_block_shares_sum_to_a1_which_t1_bounds():
    q, keys, values, k_quant, v_hat = _head_inputs()
    kv_of_q = torch.arange(H_Q) // (H_Q // H_KV)
    radius = reference.logit_radius(q, k_quant, sm_scale=SM_SCALE, delta=DELTA, kv_head_of_query=kv_of_q)
    probs = torch.softmax(SM_SCALE * torch.einsum("hd,shd->hs", q, k_quant.dequantize()[:, kv_of_q]), dim=-1)
    t1 = reference.accumulate_certificate(probs, radius).terms.t1
    a1 = (probs * torch.expm1(radius)).sum(-1)
    blocks = torch.arange(S) // BLOCK
    for head in range(H_Q):
        shares = block_shares(probs[head], radius[head], blocks, S // BLOCK)
        assert float(shares.sum()) == pytest.approx(float(a1[head]), rel=1e-5)
        assert float(shares.sum()) <= float(t1[head]) * (1 + 1e-6)
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
    rows = sum(len(pairs) for pairs in backup.fetched)
    assert int(gated.repaired_bytes.sum()) == rows * D * 2 * 2
    # The first round pages in, for each KV head read by a head above tau, its block of largest share
    # (summed over those heads).
    kv_of_q = torch.arange(H_Q) // (H_Q // H_KV)
    radius = reference.logit_radius(q, k_quant, sm_scale=SM_SCALE, delta=DELTA, kv_head_of_query=kv_of_q)
    probs = torch.softmax(SM_SCALE * torch.einsum("hd,shd->hs", q, k_quant.dequantize()[:, kv_of_q]), dim=-1)
    shares = block_shares(probs, radius, torch.arange(S) // BLOCK, S // BLOCK)
    over = observed.certificate > tau
    expected = {
        kv: {int(shares[over & (kv_of_q == kv)].sum(0).argmax())}
        for kv in range(H_KV)
        if bool(over[kv_of_q == kv].any())
    }
    assert backup.blocks(0) == expected
    # Minimal: without the last round's blocks paged in, some head would still be above tau.
    without_last = mask.clone()
    for position, kv_head in backup.fetched[-1]:
        without_last[position, kv_head] = False
    replay, _ = _decode(q, k_quant, v_hat, None, None, exact=(without_last, exact_k, exact_v))
    assert bool((replay.certificate > tau).any())


def _greedy_one_block_at_a_time(q, keys, k_quant, tau, block):
    """The blocks per KV head that one-block-at-a-time repair pages in: the first head above tau gets its
    block of largest share, then everything is recomputed (the order the round-based path must stay within
    twice of)."""
    kv_of_q = torch.arange(H_Q) // (H_Q // H_KV)
    mask = torch.zeros(S, H_KV, dtype=torch.bool)
    base_radius = reference.logit_radius(q, k_quant, sm_scale=SM_SCALE, delta=DELTA, kv_head_of_query=kv_of_q)
    blocks = torch.arange(S) // block
    paged = [0] * H_KV
    while True:
        k_eff = torch.where(mask[..., None], keys.float(), k_quant.dequantize())
        probs = torch.softmax(SM_SCALE * torch.einsum("hd,shd->hs", q, k_eff[:, kv_of_q]), dim=-1)
        radius = base_radius.masked_fill(mask.T[kv_of_q], 0.0)
        certificate = reference.accumulate_certificate(probs, radius).certificate
        over = ~(certificate <= tau)
        if not bool(over.any()):
            return paged
        head = int(over.nonzero()[0])
        kv = int(kv_of_q[head])
        shares = block_shares(probs[head], radius[head], blocks, -(-S // block))
        pending = torch.zeros_like(shares, dtype=torch.bool).index_fill_(0, blocks[~mask[:, kv]], True)
        chosen = int(torch.where(pending, shares, -1.0).argmax())
        mask[blocks == chosen, kv] = True
        paged[kv] += 1


@pytest.mark.parametrize("seed", range(6))
def test_rounds_page_in_at_most_twice_the_one_block_greedy(seed):
    block = 4  # 24 blocks per KV head: room for several doubling rounds
    q, keys, values, k_quant, v_hat = _head_inputs(seed=seed, sharpness=1.0 + seed % 3)
    observed, _ = _decode(q, k_quant, v_hat, None, None, block=block)
    kv_of_q = torch.arange(H_Q) // (H_Q // H_KV)
    for tau in (float(observed.certificate.min()) / 4, float(observed.certificate.median()) * 0.9):
        backup = _Backup(keys, values)
        gated, (mask, exact_k, exact_v) = _decode(q, k_quant, v_hat, backup, tau, block=block)
        assert bool((gated.certificate <= tau).all())
        greedy = _greedy_one_block_at_a_time(q, keys, k_quant, tau, block)
        rounds = len(backup.fetched)
        assert rounds <= math.ceil(math.log2(S // block)) + 1
        replay_mask = torch.zeros_like(mask)
        paged = [0] * H_KV
        for call in range(rounds):
            # Each round pages in only for KV heads read by a head above tau at its start, and at most
            # max(1, n) blocks of a KV head that has n already.
            state, _ = _decode(q, k_quant, v_hat, None, None, exact=(replay_mask.clone(), exact_k, exact_v))
            over_kv = {int(kv_of_q[h]) for h in (~(state.certificate <= tau)).nonzero().squeeze(-1).tolist()}
            for kv, new_blocks in backup.blocks(call, block).items():
                assert kv in over_kv
                assert len(new_blocks) <= max(1, paged[kv])
                paged[kv] += len(new_blocks)
            for position, kv_head in backup.fetched[call]:
                replay_mask[position, kv_head] = True
        assert torch.equal(replay_mask, mask)
        for kv in range(H_KV):
            assert paged[kv] <= 2 * greedy[kv], (paged, greedy)
        if sum(greedy) > 4:
            assert rounds < sum(greedy)  # fewer recomputations than one block at a time


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


def _mixed_oracle(q, pool, keys, values, skip, rows, length):
    """float64 attention over mixed keys: exact K/V at the skipped pairs (radius 0), dequantized elsewhere."""
    kv_of_q = torch.arange(H_Q) // (H_Q // H_KV)
    outs, lses, certificates, exact_argmax = [], [], [], []
    for b in range(rows):
        slots = torch.arange(b * length, (b + 1) * length)
        exact = skip[slots]  # [S, H_kv]
        k_mix = torch.where(exact[..., None], keys[slots].double(), pool.dequantize(0, slots, "k", torch.float64))
        v_mix = torch.where(exact[..., None], values[slots].double(), pool.dequantize(0, slots, "v", torch.float64))
        q64 = q[b].double()
        logits = SM_SCALE * torch.einsum("hd,shd->hs", q64, k_mix[:, kv_of_q])
        probs = torch.softmax(logits, dim=-1)
        radius = reference.logit_radius(
            q64, pool.quantized(0, slots, "k"), sm_scale=SM_SCALE, delta=DELTA, kv_head_of_query=kv_of_q
        ).masked_fill(exact.T[kv_of_q], 0.0)
        outs.append(torch.einsum("hs,shd->hd", probs, v_mix[:, kv_of_q]))
        lses.append(torch.logsumexp(logits, dim=-1))
        # The repaired tokens are exact: they add their weight to P_rest alone.
        certificates.append(reference.accumulate_certificate(probs, radius, exact.T[kv_of_q]).certificate)
        exact_argmax.append(exact.T[kv_of_q].gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1))
    stack = torch.stack
    return stack(outs), stack(lses), stack(certificates), stack(exact_argmax)


def test_kernel_plus_exact_merge_equals_attention_over_mixed_keys():
    rows, length = 3, 48
    generator = torch.Generator().manual_seed(7)
    q = (3.0 * torch.randn(rows, H_Q, D, generator=generator)).to(torch.float16)
    keys = torch.randn(rows * length, H_KV, D, generator=generator).to(torch.float16)
    values = torch.randn(rows * length, H_KV, D, generator=generator).to(torch.float16)
    skip = torch.rand(rows * length, H_KV, generator=generator) < 0.3
    skip[:length, 0] = True  # row 0, KV head 0: every token repaired (no quantized token read)
    skip[length : 2 * length, 1] = False  # row 1, KV head 1: nothing repaired (the kernel's values stand)
    # Row 2, query head 0: its largest logit sits on a repaired token.
    skip[2 * length + 5, 0] = True
    keys[2 * length + 5, 0] = (2.0 * D**0.5 * q[2, 0].float() / q[2, 0].float().norm()).to(torch.float16)
    pool = KVPool(rows * length, 1, H_KV, D, seed=11)
    slots = torch.arange(rows * length)
    pool.write(0, slots, keys, values)

    indptr = torch.arange(rows + 1) * length
    kernel = decode_attention(q, pool, 0, indptr, slots, sm_scale=SM_SCALE, delta_step=DELTA, skip=skip)
    pair_slot, pair_head = skip.nonzero(as_tuple=True)
    exact = exact_attention(
        q,
        keys[pair_slot, pair_head],
        values[pair_slot, pair_head],
        pair_slot // length,
        pair_head,
        num_kv_heads=H_KV,
        sm_scale=SM_SCALE,
    )
    merged = merge_exact(kernel.out, kernel.lse, kernel.accumulators, kernel.certificate, exact)

    out, lse, certificate, exact_argmax = _mixed_oracle(q, pool, keys, values, skip, rows, length)
    torch.testing.assert_close(merged.out.double(), out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(merged.lse.double(), lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged.certificate.double(), certificate, rtol=1e-4, atol=0.0)
    # The cases the merge distinguishes all occur, each with a certificate that is not trivially zero.
    only_exact = torch.zeros(rows, H_Q, dtype=torch.bool)
    only_exact[0, : H_Q // H_KV] = True
    assert bool((merged.certificate[only_exact] == 0).all())
    assert bool(exact_argmax[2, 0]) and bool((certificate[exact_argmax & ~only_exact] > 0).all())
    assert bool((~exact_argmax).any())
    no_exact = torch.zeros(rows, H_Q, dtype=torch.bool)
    no_exact[1, H_Q // H_KV :] = True
    assert torch.equal(merged.certificate[no_exact], kernel.certificate[no_exact])
    assert torch.equal(merged.out[no_exact], kernel.out[no_exact])


def test_merge_of_an_overflowed_accumulator_is_inf_never_nan():
    shape = (1, 2)
    zero = torch.zeros(shape)
    # Head 0: the kernel's held-apart token has an overflowing radius. Head 1: its rest sums overflowed.
    accumulators = reference.CertificateAccumulators(
        a1_rest=torch.tensor([[0.1, math.inf]]),
        b_rest=torch.tensor([[0.01, math.inf]]),
        u_rest=torch.tensor([[0.05, math.inf]]),
        p_rest=torch.tensor([[0.5, 0.5]]),
        p_max=torch.tensor([[0.5, 0.5]]),
        u_max=torch.tensor([[1e4, 0.1]]),
    )
    exact = ExactPart(out=torch.zeros(1, 2, 3), lse=zero.clone())
    merged = merge_exact(torch.zeros(1, 2, 3), zero.clone(), accumulators, zero.clone(), exact)
    assert torch.equal(merged.certificate, torch.full(shape, math.inf))


def _cache_inputs(seed: int = 0):
    config = LlamaConfig(
        vocab_size=16, hidden_size=H_Q * D, num_hidden_layers=1, num_attention_heads=H_Q, num_key_value_heads=H_KV
    )
    generator = torch.Generator().manual_seed(seed)
    batch = 3
    keys = torch.randn(batch, H_KV, S, D, generator=generator)
    values = torch.randn(batch, H_KV, S, D, generator=generator)
    query = 4.0 * torch.randn(batch, H_Q, D, generator=generator)
    return config, keys, values, query


def test_repaired_rows_are_read_through_the_kernel_and_merge_at_the_next_step(monkeypatch):
    config, keys, values, query = _cache_inputs()
    observe = WitcertCache(config, CachePolicy(mode="observe", seed=0), max_cache_len=S)
    observe.layers[0].update(keys, values)
    observed = []
    observe.audit = lambda cache, layer, q, certificate, sm: observed.append(certificate.clone())
    observe.decode(0, query, SM_SCALE)
    tau = float(observed[0].median())  # about half the heads must be repaired

    calls = []

    def counting(*args, **kwargs):
        calls.append(kwargs["tau"])
        return certified_decode_rows(*args, **kwargs)

    monkeypatch.setattr(gating, "certified_decode_rows", counting)
    aggregator = CertificateAggregator(1, H_Q, tau=tau, stride=1, device="cpu")
    cache = WitcertCache(config, CachePolicy(mode="gate", tau=tau, seed=0), max_cache_len=S, observer=aggregator)
    cache.layers[0].update(keys, values)
    reported = []
    cache.audit = lambda cache, layer, q, certificate, sm: reported.append(certificate.clone())
    first = cache.decode(0, query, SM_SCALE)
    repair_calls, fallbacks, repaired_bytes = len(calls), int(cache.fallback_total), int(cache.repaired_bytes_total)
    assert repair_calls == 1  # every row above tau goes to the repair path in one call
    assert fallbacks > 0 and len(cache.repaired[0]) > 0
    assert bool(cache.skip[0].any())

    second = cache.decode(0, query, SM_SCALE)  # the next step, same query: the kernel skips what was repaired
    assert len(calls) == repair_calls  # no row went to the per-row repair path again
    assert bool((reported[1] <= tau).all())
    torch.testing.assert_close(second, first, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(reported[1], reported[0], rtol=1e-4, atol=1e-7)
    assert int(cache.fallback_total) == fallbacks and int(cache.repaired_bytes_total) == repaired_bytes
    snapshot = aggregator.snapshot()
    assert int(snapshot.fallbacks.sum()) == fallbacks and int(snapshot.repaired_bytes.sum()) == repaired_bytes
    assert (snapshot.covered == snapshot.samples).all()


def test_in_generation_the_repair_path_runs_only_to_page_in_something(monkeypatch):
    model = random_model(layers=2, hidden=128, q_heads=4, kv_heads=2, head_dim=32, vocab=256, init_std=0.15)
    use_witcert_attention(model)
    prompt = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    decoded = []

    def counting(*args, **kwargs):
        decoded.append(certified_decode_rows(*args, **kwargs))
        return decoded[-1]

    monkeypatch.setattr(gating, "certified_decode_rows", counting)
    reported = []
    cache = WitcertCache(
        model.config,
        CachePolicy(mode="gate", tau=0.03),
        max_cache_len=64,
        audit=lambda cache, layer, q, certificate, sm: reported.append(certificate.clone()),
    )
    greedy_generate(model, prompt, cache, 9, min_new_tokens=9)
    assert len(decoded) > 0
    # A row reaches the repair path only when its merged certificate exceeds tau, so it always pages in.
    assert all(bool(rows.fallback.any(-1).all()) for rows in decoded)
    assert bool((torch.cat(reported) <= 0.03).all())


def test_a_head_that_stays_above_tau_with_every_token_exact_raises_rather_than_loops():
    q, keys, values, k_quant, v_hat = _head_inputs(seed=2)
    q[1, 0] = math.nan  # its certificate is NaN whatever gets paged in
    backup = _Backup(keys, values)
    with pytest.raises(RuntimeError, match="stay above tau"):
        _decode(q, k_quant, v_hat, backup, 0.5)
    paged = {pair for pairs in backup.fetched for pair in pairs}
    assert {(position, 0) for position in range(S)} <= paged  # the NaN head's KV head was paged in entirely


def test_rows_repaired_together_page_in_what_each_row_alone_would_in_as_many_rounds_as_the_longest():
    inputs = [_head_inputs(seed=seed, sharpness=2.0 + seed) for seed in range(3)]
    tau = 0.5 * min(
        float(_decode(q, k_quant, v_hat, None, None)[0].certificate.median()) for q, _, _, k_quant, v_hat in inputs
    )
    alone, alone_rounds, alone_pages = [], [], []
    for q, keys, values, k_quant, v_hat in inputs:
        backup = _Backup(keys, values)
        alone.append(_decode(q, k_quant, v_hat, backup, tau)[0])
        alone_rounds.append(len(backup.fetched))
        alone_pages.append({pair for pairs in backup.fetched for pair in pairs})

    rounds: list[list[tuple[int, int, int]]] = []

    def fetch(rows, positions, kv_heads):
        rounds.append(list(zip(rows.tolist(), positions.tolist(), kv_heads.tolist(), strict=True)))
        return (
            torch.stack([inputs[r][1][p, h] for r, p, h in rounds[-1]]),
            torch.stack([inputs[r][2][p, h] for r, p, h in rounds[-1]]),
        )

    together = certified_decode_rows(
        torch.stack([q for q, *_ in inputs]),
        [k_quant for *_, k_quant, _ in inputs],
        torch.stack([v_hat for *_, v_hat in inputs]),
        torch.zeros(3, S, H_KV, dtype=torch.bool),
        torch.zeros(3, S, H_KV, D),
        torch.zeros(3, S, H_KV, D),
        sm_scale=SM_SCALE,
        delta=DELTA,
        tau=tau,
        fetch=fetch,
        block_size=BLOCK,
    )
    assert len(rounds) == max(alone_rounds) > 1
    assert bool((together.certificate <= tau).all())
    for r, row in enumerate(alone):
        assert {(p, h) for pairs in rounds for rr, p, h in pairs if rr == r} == alone_pages[r]
        torch.testing.assert_close(together.certificate[r], row.certificate, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(together.out[r], row.out, rtol=1e-5, atol=1e-6)
        assert torch.equal(together.fallback[r], row.fallback)
        assert torch.equal(together.repaired_bytes[r], row.repaired_bytes)


class _Observer:
    """Keeps every ``observe_layers`` call's certificates, fallbacks and repaired bytes."""

    def __init__(self) -> None:
        self.steps: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []

    def observe_layers(self, first_layer, certificates, fallback=None, repaired_bytes=None) -> None:
        self.steps.append(tuple(None if x is None else x.clone() for x in (certificates, fallback, repaired_bytes)))


def test_certified_decode_writes_certificates_into_the_report_buffer_and_reports_an_unfinished_step_first():
    """Observe mode with a report: the kernel writes each layer's certificates into the report's buffer (no copy per
    layer), the observer counts the step once its last layer is in, and a step that stopped after layer 0 is
    reported, with its own values, before the next step's layer 0 overwrites them."""
    generator = torch.Generator().manual_seed(3)
    pool = KVPool(64, 2, H_KV, D, seed=5)
    for layer in range(2):
        keys, values = (torch.randn(64, H_KV, D, generator=generator).to(torch.float16) for _ in range(2))
        pool.write(layer, torch.arange(64), keys, values)
    observer = _Observer()
    report = StepReport(observer, 2, 2, H_Q, gate=False, device=torch.device("cpu"), owner="the test")
    decode = CertifiedDecode(pool, CachePolicy(mode=GateMode.OBSERVE), DELTA, report=report)
    paging = DecodePaging.build(torch.tensor([0, 40, 64]), torch.arange(64), gate=False)
    q = (4.0 * torch.randn(2, H_Q, D, generator=generator)).to(torch.float16)
    steps = [decode(layer, q, paging, SM_SCALE) for layer in range(2)]
    for layer, step in enumerate(steps):
        assert step.certificate.data_ptr() == report.certificates[layer].data_ptr()
        plain = decode_attention(
            q, pool, layer, paging.kv_indptr, paging.kv_indices, sm_scale=SM_SCALE, delta_step=DELTA
        )
        assert torch.equal(step.certificate, plain.certificate)
    ((certificates, _, _),) = observer.steps
    assert torch.equal(certificates, torch.stack([step.certificate for step in steps]))
    unfinished = decode(0, q, paging, SM_SCALE).certificate.clone()  # its layer 1 never runs
    decode(0, 2 * q, paging, SM_SCALE)
    assert len(observer.steps) == 2 and torch.equal(observer.steps[1][0], unfinished[None])


def test_certified_decode_repairs_rows_of_unequal_length_sharing_a_prefix_and_reads_them_exactly_after():
    """The engine-agnostic gated step: rows of two lengths reading a shared prefix (each slot read by both) end
    within tau, each row's output is the attention over its mixed keys, the report gets what the step returns,
    and the same step again pages in nothing: the repaired pairs reach both rows through the kernel's skip and
    the merge."""
    tau = 0.02
    generator = torch.Generator().manual_seed(21)
    keys = torch.randn(80, H_KV, D, generator=generator).to(torch.float16)
    values = torch.randn(80, H_KV, D, generator=generator).to(torch.float16)
    pool = KVPool(80, 1, H_KV, D, seed=5)
    pool.write(0, torch.arange(80), keys, values)
    row_slots = [torch.arange(0, 48), torch.cat((torch.arange(0, 16), torch.arange(48, 64)))]  # 48 and 32 tokens
    kv_indices = torch.cat(row_slots)
    kv_indptr = torch.tensor([0, 48, 80])
    q = (4.0 * torch.randn(2, H_Q, D, generator=generator)).to(torch.float16)
    policy = CachePolicy(mode=GateMode.GATE, tau=tau, repair_block=8)
    skip = torch.zeros(80, H_KV, dtype=torch.bool)
    fetched: list[int] = []

    def fetch(layer, slots, kv_heads):
        fetched.append(slots.numel())
        return keys[slots, kv_heads], values[slots, kv_heads]

    observer = _Observer()
    report = StepReport(observer, 1, 2, H_Q, gate=True, device=torch.device("cpu"), owner="the test")
    decode = CertifiedDecode(
        pool, policy, DELTA, skip=[skip], stores=[RepairedStore(H_KV, D, pool.device, pool.dtype)], fetch=fetch,
        report=report,
    )  # fmt: skip
    paging = DecodePaging.build(kv_indptr, kv_indices, gate=True)
    assert paging.multiplicity == 2 and paging.indptr == [0, 48, 80]

    plain = decode_attention(q, pool, 0, kv_indptr, kv_indices, sm_scale=SM_SCALE, delta_step=DELTA)
    assert bool((plain.certificate > tau).any(-1).all())  # both rows start above tau
    first = decode(0, q, paging, SM_SCALE)
    assert len(fetched) >= 2  # one repair call per length at least
    assert bool((first.certificate <= tau).all()) and bool(first.fallback.any(-1).all())
    assert int(first.repaired_bytes.sum()) == sum(fetched) * 2 * D * 2
    ((certificate, fallback, repaired_bytes),) = observer.steps
    assert torch.equal(certificate[0], first.certificate) and torch.equal(fallback[0], first.fallback)
    assert torch.equal(repaired_bytes[0], first.repaired_bytes)
    kv_of_q = torch.arange(H_Q) // (H_Q // H_KV)
    for row, slots in enumerate(row_slots):
        exact = skip[slots][..., None]
        k_mix = torch.where(exact, keys[slots].double(), pool.dequantize(0, slots, "k", torch.float64))
        v_mix = torch.where(exact, values[slots].double(), pool.dequantize(0, slots, "v", torch.float64))
        probs = torch.softmax(SM_SCALE * torch.einsum("hd,shd->hs", q[row].double(), k_mix[:, kv_of_q]), -1)
        expected = torch.einsum("hs,shd->hd", probs, v_mix[:, kv_of_q])
        torch.testing.assert_close(first.out[row].double(), expected, rtol=1e-4, atol=1e-5)

    fetched.clear()
    again = decode(0, q, paging, SM_SCALE)
    assert fetched == [] and not bool(again.fallback.any()) and int(again.repaired_bytes.sum()) == 0
    assert bool((again.certificate <= tau).all())
    torch.testing.assert_close(again.out, first.out, rtol=1e-5, atol=1e-6)
