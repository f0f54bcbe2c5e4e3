"""The teacher-forced quality harness: what it measures, and that it refuses what it cannot measure."""

from __future__ import annotations

import pytest
import torch

from witcert.integrations.gating import CachePolicy, GateMode
from witcert.integrations.quality import greedy_continuation, random_model, teacher_forced_quality

pytestmark = pytest.mark.usefixtures("reference_kernels")  # conftest.py: the reference path, not the interpreter


@pytest.fixture(scope="module")
def model():
    return random_model(layers=2, hidden=128, q_heads=4, kv_heads=2, head_dim=32, vocab=256, init_std=0.15)


def test_gate_mode_report_is_sound_and_closer_to_fp16(model):
    prompt = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(7))
    continuation = greedy_continuation(model, prompt, 6)
    # One dither seed for both runs: the pool's default draws a new one per pool, and the comparison below is
    # between the same quantized cache with and without repairs.
    observed = teacher_forced_quality(model, prompt, continuation, CachePolicy(mode=GateMode.OBSERVE, seed=0))
    assert observed.certificates == 2 * 2 * 4 * 6  # batch x layers x heads x steps
    assert observed.violations == 0 and observed.max_true_tv > 0
    assert observed.median_ratio >= 1.0  # a certificate never undercuts the true TV it bounds
    tau = observed.median_certificate
    gated = teacher_forced_quality(model, prompt, continuation, CachePolicy(mode=GateMode.GATE, tau=tau, seed=0))
    assert gated.violations == 0
    assert gated.fallbacks > 0
    assert gated.median_certificate <= tau
    # Repaired heads read exact keys: on this model the worst head moves less than without the gate.
    assert gated.max_true_tv <= observed.max_true_tv
    assert gated.policy["tau"] == tau and gated.steps == 6


def test_refuses_inputs_it_cannot_compare(model):
    prompt = torch.randint(0, 256, (1, 8))
    with pytest.raises(ValueError, match="same B"):
        teacher_forced_quality(model, prompt, torch.randint(0, 256, (2, 3)), CachePolicy())
    with pytest.raises(ValueError, match="at least one token"):
        teacher_forced_quality(model, prompt, torch.empty(1, 0, dtype=torch.long), CachePolicy())


@pytest.mark.slow
def test_calibrated_pairs_tighten_real_certificates_more_than_the_lowest_frequencies(trained_model):
    """The shipped calibration (m = 4, chosen on other texts) against the 4 lowest-frequency pairs, on GPL-3:
    bench/quality_table.py measures the same at every m and context (docs/QUALITY.md)."""
    from witcert.demo import SHIPPED_OUTLIERS

    model, tokenizer = trained_model
    with open("/usr/share/common-licenses/GPL-3", encoding="utf-8") as stream:
        ids = tokenizer(stream.read(), return_tensors="pt")["input_ids"][:, :1032]
    prompt, forced = ids[:, :1024], ids[:, 1024:]
    calibrated = CachePolicy(mode=GateMode.OBSERVE, seed=0, outlier_file=SHIPPED_OUTLIERS["smollm2-135m-instruct"])
    lowest = CachePolicy(mode=GateMode.OBSERVE, seed=0, outlier_pairs=4)
    with_calibrated = teacher_forced_quality(model, prompt, forced, calibrated)
    with_lowest = teacher_forced_quality(model, prompt, forced, lowest)
    assert with_calibrated.violations == 0 and with_lowest.violations == 0
    assert with_calibrated.median_certificate < 0.75 * with_lowest.median_certificate
