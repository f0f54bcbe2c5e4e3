"""The warp-specialised Gluon stage 1 (kernels/gluon_decode_ws.py) against the reference on CPU, emulated in Triton's
interpreter (tests/gluon_emulation.py: its producer and consumer partitions take turns at the ring's mbarriers).
The GPU runs the same contract compiled (test_kernels_gpu.py, with ``LAUNCH.gluon_ws``)."""

import importlib.util
import math
import os
import types
from pathlib import Path

import pytest
import torch
from triton.runtime.errors import InterpreterError

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gluon_emulation import emulated  # noqa: E402
from kernel_cases import (  # noqa: E402
    assert_matches_oracle,
    filled_pool,
    interpreter_only,
    oracle,
    overflowing_query_case,
    relative_error,
)
from test_gluon_emulated import peak_between_ends_case  # noqa: E402

import witcert.kernels  # noqa: E402
from witcert.kernels import attention, decode_attention, gluon_decode, gluon_decode_ws, reference  # noqa: E402

pytestmark = interpreter_only("the GPU runs the warp-specialised kernel compiled: test_kernels_gpu.py")

DELTA = reference.delta_step(28, 28)
KERNEL_WRITE = witcert.kernels.KVPool.write


@pytest.fixture
def run_ws(monkeypatch):
    """Decode's stage 1 is the emulated warp-specialised kernel wherever the Gluon one covers the call; call the
    fixture with another version of ``gluon_decode_ws`` to run that one."""

    def use(module: types.ModuleType = gluon_decode_ws) -> None:
        monkeypatch.setattr(witcert.kernels, "gluon_decode", emulated(gluon_decode))
        monkeypatch.setattr(witcert.kernels, "gluon_decode_ws", emulated(module))
        monkeypatch.setattr(attention, "_runs_gluon", lambda q, pool, kv_indices: attention.gluon_covers(q.dtype, pool))
        monkeypatch.setattr(attention, "_runs_gluon_ws", lambda q: True)

    use()

    def reference_write(self, *args, **kwargs):  # as in test_gluon_emulated.py: the write kernel is tested apart
        with monkeypatch.context() as scope:
            scope.setenv("TRITON_INTERPRET", "0")
            return KERNEL_WRITE(self, *args, **kwargs)

    monkeypatch.setattr(witcert.kernels.KVPool, "write", reference_write)
    return use


def _query(rows: int, heads: int, seed: int = 7, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.randn(rows, heads, 128, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize(
    ("kv_heads", "group", "page_size", "dtype", "splits", "v_dither"),
    [(2, 7, 1, torch.float16, 1, False), (1, 7, 16, torch.bfloat16, 2, True)],
    ids=["gqa7-page1-one-split", "gqa7-page16-bf16-vdither"],
)
def test_emulated_ws_decode_matches_reference(run_ws, kv_heads, group, page_size, dtype, splits, v_dither):
    """Lengths 1, 0, 129 and 700: 700 tokens are 6 tiles in one split, 3 in each of two, so the ring of 2 stages
    wraps."""
    lengths = [1, 700, 0, 129]
    pool, indptr, slots = filled_pool(lengths, kv_heads=kv_heads, page_size=page_size, v_dither=v_dither, dtype=dtype)
    q = _query(len(lengths), kv_heads * group, dtype=dtype)
    result = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA, num_kv_splits=splits)
    assert result.path == "gluon-ws-gpu"
    assert_matches_oracle(result, q, pool, 1, indptr, slots, delta=DELTA)


def test_emulated_ws_skips_pairs_and_poisons_an_out_of_range_slot(run_ws):
    lengths = [300, 150]
    pool, indptr, slots = filled_pool(lengths, kv_heads=2, v_dither=False)
    q = _query(2, 14)
    skip = torch.rand(pool.num_slots, 2, generator=torch.Generator().manual_seed(11)) < 0.3
    skip[slots[:128], 1] = True  # row 0, KV head 1: a whole first tile skipped before live tokens
    bad = slots.clone()
    bad[420] = 2**30  # row 1
    result = decode_attention(q, pool, 1, indptr, bad, delta_step=DELTA, num_kv_splits=1, skip=skip, validate=False)
    assert result.path == "gluon-ws-gpu"
    expected = oracle(q[0], pool, 1, slots[:300], delta=DELTA, skip=skip)
    assert relative_error(result.out[0], expected.out) <= 1e-5
    torch.testing.assert_close(result.certificate[0], expected.certificate, rtol=1e-4, atol=0.0)
    assert torch.isnan(result.certificate[1]).all() and torch.isnan(result.out[1]).all()


def test_emulated_ws_without_certificate_gives_the_same_output(run_ws):
    pool, indptr, slots = filled_pool([600, 5], kv_heads=1, v_dither=False)
    q = _query(2, 7)
    with_cert = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA, num_kv_splits=1)
    without = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA, num_kv_splits=1, certificate=False)
    assert without.path == "gluon-ws-gpu" and without.certificate is None
    assert torch.equal(with_cert.out, without.out) and torch.equal(with_cert.lse, without.lse)


def test_emulated_ws_holds_an_end_tiles_token_where_the_peak_lies_between_the_ends(run_ws):
    """``test_gluon_emulated``'s case in four splits: the consumers tell the row's end tiles by its length, not by
    the split's end (row 0's last split ends with the row; its first two and row 1's second do not)."""
    pool, indptr, slots, q = peak_between_ends_case()
    result = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA, num_kv_splits=4)
    assert result.path == "gluon-ws-gpu"
    assert_matches_oracle(result, q, pool, 1, indptr, slots, delta=DELTA)


def test_emulated_ws_gives_an_infinite_certificate_where_the_radius_overflows(run_ws):
    pool, indptr, slots, q, sm_scale = overflowing_query_case(zero_groups=True)
    result = decode_attention(q, pool, 1, indptr, slots, sm_scale=sm_scale, delta_step=DELTA)
    assert result.path == "gluon-ws-gpu"
    assert torch.isposinf(result.certificate).all()


def _without(text: str, line: str) -> str:
    assert text.count(line) == 1, line
    return text.replace(line, "")


@pytest.mark.parametrize(
    ("dropped", "error"),
    [
        # The consumers never free a stage: the producer waits for it forever.
        ("        mbarrier.arrive(empty.index(stage), count=1)\n", "deadlock"),
        # The consumers do not wait for the copies: they read stages before the producer filled them, and free
        # stages out of turn, so the producer's parity waits lose step with them.
        ("        mbarrier.wait(full.index(stage), phase)\n", "deadlock|row 0"),
    ],
    ids=["no-release", "no-wait"],
)
def test_the_emulation_tells_a_broken_handshake(run_ws, tmp_path, dropped, error):
    """The emulated partitions take turns only at the mbarriers, so a handshake left out shows: as a deadlock, or
    as a stage read before it was filled (its zeros differ from the reference)."""
    path = tmp_path / "gluon_decode_ws_broken.py"
    path.write_text(_without(Path(gluon_decode_ws.__file__).read_text(), dropped))
    spec = importlib.util.spec_from_file_location("gluon_decode_ws_broken", path)
    broken = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(broken)
    run_ws(broken)
    lengths = [20, 1000]
    pool, indptr, slots = filled_pool(lengths, kv_heads=1, v_dither=False)
    q = _query(2, 7)
    with pytest.raises((InterpreterError, AssertionError), match=error):
        result = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA, num_kv_splits=1)
        assert_matches_oracle(result, q, pool, 1, indptr, slots, delta=DELTA)


def test_emulated_ws_counts_no_more_than_its_tokens(run_ws):
    """One token per row: the producer's tile is all past the end but the first (zero-filled, weighing nothing)."""
    pool, indptr, slots = filled_pool([1, 1], kv_heads=1, v_dither=False)
    q = _query(2, 7)
    result = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA, num_kv_splits=1)
    assert result.path == "gluon-ws-gpu"
    assert torch.all(result.certificate == 0) and not math.isnan(float(result.out.sum()))
    assert_matches_oracle(result, q, pool, 1, indptr, slots, delta=DELTA)
