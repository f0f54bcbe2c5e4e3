"""Run the Gluon stage 1's emulated contract tests (``tests/test_gluon_emulated.py``) with a what-if in its place.

A what-if that claims to compute what the kernel does (``whatif_stage1.py``'s code changes) can be checked on the
CPU before any GPU time is spent on it: the same cases against the reference, in Triton's interpreter, with the
what-if's module where ``kernels/gluon_decode.py`` would be. What the emulation cannot see (register placement,
races between warps, ``ex2.approx``'s last bits; ``docs/KERNELS.md``, Tests without a GPU) needs the GPU tests:
``bash bench/lab/device_session.sh whatif_tests NAME``.

    python bench/lab/emulate_whatif.py radiusearly          # a what-if by name
    python bench/lab/emulate_whatif.py --file stage1.py     # or a stage 1 written before
    python bench/lab/emulate_whatif.py certearly -- -k mha  # arguments after -- go to pytest

The exit status is pytest's.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import pytest

# The kernels read it when first imported, which importing bench_kernels does.
os.environ.setdefault("TRITON_INTERPRET", "1")
_ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(_ROOT / "bench"), str(_ROOT / "bench" / "lab")]
from bench_kernels import load_stage1  # noqa: E402
from whatif_stage1 import VARIANTS, current_source, variant  # noqa: E402

# The cases that run the kernel; the others check inline PTX blocks, which what-ifs do not change.
_KERNEL_CASES = "not ptx and not neg_codes and not transposed"


class _StageOnePlugin:
    """Puts ``module`` where ``witcert.kernels.gluon_decode`` is before the tests import it, so that their
    ``from witcert.kernels import gluon_decode`` and the fixture that emulates it get the what-if."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def pytest_configure(self, config: pytest.Config) -> None:
        import witcert.kernels

        module = load_stage1(self.path)
        sys.modules["witcert.kernels.gluon_decode"] = module
        witcert.kernels.gluon_decode = module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant", nargs="?", help=f"a what-if of whatif_stage1.py ({', '.join(VARIANTS)})")
    parser.add_argument("--file", type=Path, help="a stage 1 already written (a whatif_stage1.py output)")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: more pytest arguments")
    args = parser.parse_args(argv)
    if (args.variant is None) == (args.file is None):
        parser.error("name a what-if or give --file, not both")
    if args.variant and any(part not in VARIANTS for part in args.variant.split("+")):
        parser.error(f"unknown what-if {args.variant}; choose from {', '.join(VARIANTS)}")
    extra = [arg for arg in args.pytest_args if arg != "--"]
    with tempfile.TemporaryDirectory() as folder:
        path = args.file
        if path is None:
            path = Path(folder) / f"stage1_{args.variant.replace('+', '_')}.py"
            path.write_text(variant(args.variant, current_source()))
        tests = str(_ROOT / "tests" / "test_gluon_emulated.py")
        return pytest.main([tests, "-q", "-k", _KERNEL_CASES, "-p", "no:cacheprovider", *extra],
                           plugins=[_StageOnePlugin(path.resolve())])  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
