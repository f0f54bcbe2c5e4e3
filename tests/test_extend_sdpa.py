"""The SDPA extend path's host-side plan (``extend_bounds``) and its attention, on CPU.

``extend_attention`` takes this path only on a GPU (``extend_sdpa.covers``); ``attend`` itself runs
anywhere SDPA does, so CI checks its grouping of sequences into batched calls against the float32
reference here, and the H200 tests check the whole path (``test_kernels_gpu.py``)."""

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import extend_oracle, filled_pool, relative_error
from torch.overrides import TorchFunctionMode

from witcert.kernels import extend_sdpa
from witcert.kernels.extend_bounds import EqualRun, ExtendBounds, equal_runs
from witcert.kernels.launch import LAUNCH

DELTA = 1e-3


def test_equal_runs_group_consecutive_sequences_of_one_shape():
    # Three prefix hits of 4 new over 10, an idle sequence, the same shape again, then a 3-token prompt.
    qo = [0, 4, 8, 12, 12, 16, 19]
    kv = [0, 10, 20, 30, 35, 45, 48]
    assert equal_runs(qo, kv) == [
        EqualRun(q_start=0, kv_start=0, count=3, new=4, seen=10),
        # The idle sequence's 5 keys lie between: not one run with the first three.
        EqualRun(q_start=12, kv_start=35, count=1, new=4, seen=10),
        EqualRun(q_start=16, kv_start=45, count=1, new=3, seen=3),
    ]
    assert equal_runs([0, 8, 16], [0, 8, 16]) == [EqualRun(0, 0, 2, 8, 8)]
    assert equal_runs([0, 0], [0, 7]) == []


def test_attend_batches_equal_sequences_and_matches_the_reference(monkeypatch):
    """Grouped SDPA calls (one per run) over the gathered K/V: every new token of every sequence within the
    accuracy of half-precision attention of the float32 reference."""
    prefix, new = [6, 6, 6, 5, 6, 0], [4, 4, 4, 0, 4, 3]
    pool, kv_indptr, slots = filled_pool([p + n for p, n in zip(prefix, new, strict=True)], kv_heads=2, v_dither=False)
    qo_indptr = torch.tensor([0, 4, 8, 12, 12, 16, 19])
    # One query head per KV head: CPU SDPA's bottom-right causal mask has no GQA (the H200 test has 7:1).
    q = torch.randn(19, 2, 128, generator=torch.Generator().manual_seed(5)).half()
    calls = []

    class CountCalls(TorchFunctionMode):
        # A function mode, not a wrapper: SDPA's causal-bias dispatch checks which function it was called as.
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.scaled_dot_product_attention:
                calls.append(args[0].shape[0])
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(LAUNCH, "extend_sdpa_max_calls", 8)
    bounds = ExtendBounds(qo_indptr.tolist(), kv_indptr.tolist())
    with CountCalls():
        out = extend_sdpa.attend(q, pool, 1, bounds, (qo_indptr, kv_indptr), slots, sm_scale=128**-0.5)
    assert out.dtype == torch.float16 and calls == [3, 1, 1]
    for row in range(19):
        expected = extend_oracle(q, pool, qo_indptr, kv_indptr, slots, prefix, row, delta=DELTA)
        assert relative_error(out[row], expected.out) < 4e-3, row


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_sdpa_path_is_not_taken_off_the_gpu(dtype):
    pool, _, _ = filled_pool([4], kv_heads=2, v_dither=False)
    assert not extend_sdpa.covers(torch.zeros(4, 14, 128, dtype=dtype), pool)


def test_one_sequence_too_long_to_gather_does_not_fit(monkeypatch):
    pool, _, _ = filled_pool([4], kv_heads=2, v_dither=False)
    q = torch.zeros(4, 14, 128, dtype=torch.float16)
    bounds = ExtendBounds([0, 2, 4], [0, 100, 150])
    monkeypatch.setattr(LAUNCH, "extend_sdpa_max_bytes", 100 * extend_sdpa.key_bytes(q, pool))
    assert extend_sdpa.fits(q, pool, bounds)
    monkeypatch.setattr(LAUNCH, "extend_sdpa_max_bytes", 99 * extend_sdpa.key_bytes(q, pool))
    assert not extend_sdpa.fits(q, pool, bounds)


def test_extend_bounds_split_into_chunks_of_consecutive_sequences():
    bounds = ExtendBounds([0, 2, 4, 6, 8], [0, 10, 30, 35, 100])  # 10, 20, 5 and 65 keys
    assert bounds.chunks(100) == [(0, 4)]
    assert bounds.chunks(30) == [(0, 2), (2, 3), (3, 4)]  # the 65-key sequence alone
    assert bounds.chunks(25) == [(0, 1), (1, 3), (3, 4)]
    assert bounds.part(1, 3) == ExtendBounds([0, 2, 4], [0, 20, 25])


def test_attend_in_chunks_matches_the_reference(monkeypatch):
    """A chunk limit of 12 keys gathers the batch a few sequences at a time; every row still matches."""
    prefix, new = [6, 6, 0, 5, 2], [4, 4, 3, 2, 5]
    pool, kv_indptr, slots = filled_pool([p + n for p, n in zip(prefix, new, strict=True)], kv_heads=2, v_dither=False)
    qo_indptr = torch.tensor([0, 4, 8, 11, 13, 18])
    q = torch.randn(18, 2, 128, generator=torch.Generator().manual_seed(9)).half()
    bounds = ExtendBounds(qo_indptr.tolist(), kv_indptr.tolist())
    key = extend_sdpa.key_bytes(q, pool)
    monkeypatch.setattr(LAUNCH, "extend_sdpa_chunk_bytes", 12 * key)
    assert len(bounds.chunks(12)) == 4
    gathered = []
    gather = pool.gather

    def counted(layer, slots, *args, **kwargs):
        gathered.append(len(slots))
        return gather(layer, slots, *args, **kwargs)

    monkeypatch.setattr(pool, "gather", counted)
    out = extend_sdpa.attend(q, pool, 1, bounds, (qo_indptr, kv_indptr), slots, sm_scale=128**-0.5)
    for row in range(18):
        expected = extend_oracle(q, pool, qo_indptr, kv_indptr, slots, prefix, row, delta=DELTA)
        assert relative_error(out[row], expected.out) < 4e-3, row
    assert gathered == [10, 10, 3 + 7, 7]


def test_extend_bounds_are_checked_once_and_against_each_call():
    bounds = ExtendBounds([0, 4, 8], [0, 10, 20])
    assert bounds.longest == (4, 10) and bounds.runs == [EqualRun(0, 0, 2, 4, 10)]
    bounds.check_against(2, 8, 20)
    for qo, kv, message in (
        ([0, 4], [0, 10, 20], "B \\+ 1 entries"),
        ([1, 4, 8], [0, 10, 20], "start at 0"),
        ([0, 9, 8], [0, 10, 20], "non-decreasing"),
        ([0, 4, 8], [0, 3, 20], "at least as many KV slots"),
        ([0, 4, 8], [-1, 10, 20], "kv_indptr\\[0\\]"),
        ([0, 4, 8], [0, 20, 10], "non-decreasing"),
    ):
        with pytest.raises(ValueError, match=message):
            ExtendBounds(qo, kv)
    for call, message in (
        ((3, 8, 20), "B \\+ 1 entries each"),
        ((2, 9, 20), "qo_indptr\\[-1\\] = 8"),
        ((2, 8, 19), "exceeds len\\(kv_indices\\)"),
    ):
        with pytest.raises(ValueError, match=message):
            bounds.check_against(*call)
