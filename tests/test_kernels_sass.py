"""The Gluon stage 1 compiles for sm_90 on a machine without a GPU and keeps its operands in registers.

Gluon has no interpreter, so CI cannot run it (its contract tests run on the H200: ``pytest -m gpu``);
what CI can check is the property it exists for, in its SASS: the token loop stages no operand through
shared memory and needs no barrier, and its tensor-core work is the expected count of ``mma.sync``.
The compile runs in a fresh process with ``TRITON_INTERPRET=0``: this test session interprets Triton's
library functions, which a compiled Gluon kernel cannot call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton.experimental.gluon")


@pytest.fixture(scope="module")
def loop_opcodes() -> dict[str, dict[str, int]]:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "witcert.kernels.sass", "gluon"], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("certificate", [True, False], ids=["certificate", "no-certificate"])
def test_gluon_token_loop_keeps_operands_in_registers(loop_opcodes, certificate):
    loop = loop_opcodes[str(certificate)]
    assert loop.get("STS", 0) == 0, "an operand goes through shared memory in the token loop"
    assert loop.get("BAR", 0) == 0, "the warps synchronise inside the token loop"
    # Shared memory is read only for q's per-group norms: the dither offsets (4), and the radius's
    # squared and absolute norms (8) with the certificate; one 64-bit read each.
    assert loop.get("LDS", 0) == (12 if certificate else 4)
    # Per warp and 128-token tile: QK 4 groups x (codes, dither) x 2 row tiles x 2 k steps = 32, PV
    # 2 token halves x 2 channel halves x 3 products x 4 row tiles = 48.
    assert loop.get("HMMA", 0) == 80
