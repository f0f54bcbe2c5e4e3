"""The Gluon stage 1 compiles for sm_90 on a machine without a GPU and keeps its operands in registers.

Gluon has no interpreter, so CI cannot run it (its contract tests run on the H200: ``pytest -m gpu``);
what CI can check is the property it exists for, in its SASS: the token loop stages no operand through
shared memory and needs no barrier, and its tensor-core work is the expected count of ``mma.sync``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton.experimental.gluon")

from witcert.kernels.sass import compile_cubin, profile  # noqa: E402


@pytest.mark.parametrize("certificate", [True, False], ids=["certificate", "no-certificate"])
def test_gluon_token_loop_keeps_operands_in_registers(certificate):
    loop = profile(compile_cubin(kernel_name="gluon", certificate=certificate)).loop_opcodes
    assert loop["STS"] == 0, "an operand goes through shared memory in the token loop"
    assert loop["BAR"] == 0, "the warps synchronise inside the token loop"
    # Shared memory is read only for q's per-group norms: the dither offsets (4), and the radius's
    # squared and absolute norms (8) with the certificate; one 64-bit read each.
    assert loop["LDS"] == (12 if certificate else 4)
    # Per warp and 128-token tile: QK 4 groups x (codes, dither) x 2 row tiles x 2 k steps = 32, PV
    # 2 token halves x 2 channel halves x 3 products x 4 row tiles = 48.
    assert loop["HMMA"] == 80
