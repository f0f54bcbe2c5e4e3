"""The Gluon stage 1 compiles for sm_90 on a machine without a GPU, with its token loop as designed.

Gluon has no interpreter: CI runs its algorithm emulated in Triton's (``test_gluon_emulated.py``), the H200 runs it
compiled (``pytest -m gpu``); what CI can check of the compiled kernel is its SASS: codes and scales reach shared
memory only by asynchronous copies, one tile ahead (the only register-to-shared stores are 2 a tile that pass K's
token rows from the lanes that read the slots to those that copy them), the warps meet at the four barriers the
membar analysis puts around those copies and nowhere else, its tensor-core work is the expected count of
``mma.sync``, and its values fit the register cap (no spill without the certificate with V rounded, a few
otherwise). The compile runs in a fresh process with ``TRITON_INTERPRET=0``: this test session interprets Triton's
library functions, which a compiled Gluon kernel cannot call."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.experimental.gluon")


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict[str, dict[str, int]]]:
    """``tests/sass.py``'s opcode counts of the compiled token loops of the Gluon stage 1 and the tiled extend, per
    variant (one process compiles both)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    command = [sys.executable, str(Path(__file__).with_name("sass.py")), "gluon", "extend"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def loop_opcodes(compiled) -> dict[str, dict[str, int]]:
    return compiled["gluon"]


@pytest.mark.parametrize("q_dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("certificate", [True, False], ids=["certificate", "no-certificate"])
def test_gluon_token_loop_copies_the_next_tile_asynchronously(loop_opcodes, certificate, q_dtype):
    loop = loop_opcodes[f"{q_dtype} {certificate}"]
    # K's copy by rows needs each token's row in the 16 lanes that copy it: a layout conversion within the warp,
    # which Triton 3.6 and 3.9 make through shared memory (2 stores). Codes and scales are never stored from
    # registers.
    assert loop.get("STS", 0) <= 2, "registers are staged through shared memory in the token loop"
    # One barrier before each side's copy (the previous tile's reads are done) and one after each wait.
    assert loop.get("BAR", 0) == 4
    assert loop.get("DEPBAR", 0) == 2 and loop.get("LDGDEPBAR", 0) == 2
    # 8-byte copies per thread and tile: K codes 16 tokens (a half-warp copies a token's row), V codes 2 x 2 x 4,
    # and one token's scales per lane for K and for V.
    assert loop.get("LDGSTS", 0) == 16 + 16 + 1 + 1
    # Only the next tile's slot indices come from global memory into registers: once for the K and V
    # codes (V's rows are K's, shuffled within the warp) and once for each side's scale copies.
    assert loop.get("LDG", 0) <= 5, "codes, scales or extra slot indices are read from global memory"
    # The loop's values fit the register cap: without the certificate nothing spills to local memory, and
    # with it a few values per tile (fp16 / bf16 queries: 0 / 0 with Triton 3.6, the H200's; 4 / 4 with 3.9,
    # CI's, whose register allocation moves by several with small changes).
    assert loop.get("STL", 0) <= (8 if certificate else 0), "the token loop spills to local memory"
    # Per warp and 128-token tile: QK 4 groups x 2 row tiles x 2 k steps = 16 (K's dither enters the start
    # value, not an MMA), PV 2 token halves x 2 channel halves x 2 products (V against p_hi and p_mid) x 4 row
    # tiles = 32; sigma^2 one product x 2 row tiles x 2 tf32 k steps = 4, before the branch between the end
    # tiles' certificate and the others'.
    assert loop.get("HMMA", 0) == 16 + 32 + (4 if certificate else 0)


@pytest.mark.parametrize("certificate", [True, False], ids=["certificate", "no-certificate"])
def test_gluon_dithered_v_keeps_the_copies_and_mmas_of_the_token_loop(loop_opcodes, certificate):
    """A dithered V adds per tile one Philox call per token (one token per lane, then to the logits' rows) and the sums
    ``W_g``, ``Z_g`` over V's scales read once more (``_dither_sums``); its loop keeps V rounded's copies, MMAs,
    barriers and register-to-shared stores (K's token rows only), with one more load of slot indices (the tokens'
    own, for the Philox counters). Spills in the loop, Triton 3.6 (the H200's) / 3.9 (CI's): none / 1 store a tile
    without the certificate, none / 6 with it."""
    loop = loop_opcodes[f"fp16 {certificate} vdither"]
    assert loop.get("STS", 0) <= 2, "registers are staged through shared memory in the token loop"
    assert loop.get("BAR", 0) == 4
    assert loop.get("LDGSTS", 0) == 16 + 16 + 1 + 1
    assert loop.get("HMMA", 0) == 16 + 32 + (4 if certificate else 0)
    assert loop.get("LDG", 0) <= 6
    assert loop.get("STL", 0) <= (10 if certificate else 5), "the token loop spills to local memory"


def test_gluon_covers_pools_whose_32_bit_offsets_fit():
    """Rows and scale offsets stay 32-bit in the Gluon loop (only code byte offsets widen): a pool of 2**29
    (slot, KV head) rows, whose scales' element offsets reach 2**31, goes to the Triton kernel."""
    import torch

    from witcert.kernels import gluon_tiles

    shape = dict(q_dtype=torch.float16, head_dim=128, group_size=32, dither_bits=8, v_dither=False, outliers=0)
    assert gluon_tiles.supports(**shape, rows=2**29 - 1)
    assert not gluon_tiles.supports(**shape, rows=2**29)


def test_gluon_covers_a_dithered_v_and_8_bit_dithers_only():
    """The Gluon stage 1 computes a dithered V's output too; 16- and 24-bit dithers and outlier channels stay
    with the Triton kernel."""
    import torch

    from witcert.kernels import gluon_tiles

    shape = dict(q_dtype=torch.float16, head_dim=128, group_size=32, dither_bits=8, v_dither=True, outliers=0)
    assert gluon_tiles.supports(**shape, rows=1)
    assert not gluon_tiles.supports(**{**shape, "dither_bits": 16}, rows=1)
    assert not gluon_tiles.supports(**{**shape, "outliers": 2}, rows=1)


def test_tiled_extend_compiles_for_sm90_on_the_tensor_cores(compiled):
    """CI has no GPU to run the tiled extend kernel on; it compiles it, with and without the certificate, for
    the H200's architecture and checks that its dots reach the tensor cores (wgmma or mma.sync)."""
    for variant, loop in compiled["extend"].items():
        # Four groups of two QK dots and three PV dots per tile, each at least one tensor-core instruction.
        assert loop.get("HGMMA", 0) + loop.get("HMMA", 0) >= 11, variant
