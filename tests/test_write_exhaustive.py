"""The write kernel's division-free arithmetic, checked over every input it can meet (slow: C, about 5 s).

``kernels/triton_kernels.write_kernel`` rests on three float facts that no sample of random tests can
establish; the C programs in ``tests/exhaustive/`` check each over every fp16 scale (and every fp16 or
bf16 input), in IEEE float32 with fma as the GPU computes them:

* ``scale.c``: fp16 of ``amax * RN(1 / 126.5)`` stepped up once is the reference's scale, every amax;
* ``rcp.c``: one Newton step with an fma residual takes any guess within 8 ulps to ``RN(1 / s)``;
* ``markstein.c``: ``q0 = x r``, ``q = fma(fma(q0, -s, x), r, q0)`` is ``RN(x / s)`` for every fp16 x with
  ``|x| <= 126.5 s``; for bf16 x only where the remainder underflows, at ``|x / s| < 2**-100``, too small
  to move any code.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler"),
]

SOURCES = Path(__file__).parent / "exhaustive"


def _run(name: str, tmp_path: Path, *defines: str) -> str:
    binary = tmp_path / name
    # -ffp-contract=off: every fma is written out, as the kernel has it; no other fusion.
    subprocess.run(
        ["cc", "-O2", "-ffp-contract=off", *defines, str(SOURCES / f"{name}.c"), "-o", str(binary), "-lm"], check=True
    )
    return subprocess.run([str(binary)], check=True, capture_output=True, text=True, timeout=600).stdout


def test_one_step_up_from_the_reciprocal_product_gives_the_reference_scale(tmp_path):
    out = _run("scale", tmp_path, "-DSTEPS=1")
    assert re.search(r"scale: \d+ amax values, 0 differ", out), out


def test_one_newton_step_gives_the_correctly_rounded_reciprocal(tmp_path):
    out = _run("rcp", tmp_path)
    assert re.search(r"reciprocal: \d+ cases, 0 wrong", out), out


def test_the_corrected_product_is_the_correctly_rounded_quotient(tmp_path):
    out = _run("markstein", tmp_path)
    fp16 = re.search(r"fp16 x: .* mismatches there (\d+)", out)
    bf16 = re.search(r"bf16 x: .* mismatches there (\d+) \(largest \|x/s\| (\S+),", out)
    assert fp16 and int(fp16.group(1)) == 0, out
    assert bf16 and float.fromhex(bf16.group(2)) < 2.0**-100, out
