"""Count the PTX instructions of ``_decode_stage1`` compiled for sm_90, without a GPU.

Needs Triton 3.6 (the device machine's version), which may live outside the environment, e.g.
installed with ``pip install --target /tmp/t36 triton==3.6.0``. Run it with that on the path:

    PYTHONPATH=/tmp/t36 python kernels/prototypes/count_ptx.py kernels/triton_kernels.py [OTHER.py ...]

Each argument is a copy of ``kernels/triton_kernels.py`` (e.g. from a worktree with a prototype patch
applied); it is loaded by path, so the installed ``witcert`` is not involved. The kernel is compiled at
the benchmark's launch configuration (Qwen2.5-7B shape: 4 KV heads, 7 query heads each, BLOCK_H 8,
``BLOCK_N`` 64, D 128, G 32, 8-bit dithers, fp16 query, 4 warps, 16-byte-aligned arguments; V rounded
to nearest unless ``--v-dither``, 2 stages unless ``--num-stages``), with and without the certificate.
``total`` counts every instruction of the kernel (the figure docs/KERNELS.md quotes per 64-token tile:
the prologue and epilogue run once per program); ``loop`` counts those inside the token loop, i.e. per
tile. Static counts, not timings.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import re
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_INSTRUCTION = re.compile(r"\s+(?:@!?%p\d+\s+)?([a-z][\w.]*)")
_POINTERS = dict(
    Q="fp16", KCodes="i8", KScales="fp16", KOutliers="fp16", VCodes="i8", VScales="fp16", VOutliers="fp16",
    OutlierIndex="i32", OutlierChannels="i32", KvStart="i32", KvLen="i32", KvIndices="i32", Skip="i8",
    PartOut="fp32", PartLse="fp32", PartMax="fp32", PartA1="fp32", PartB="fp32", PartURest="fp32", PartPRest="fp32",
    PartU="fp32",
)  # fmt: skip
_SCALARS = dict(
    num_slots="i32", num_kv_indices="i32", stride_qb="i32", stride_qh="i32", sm_scale="fp32",
    log_two_over_delta="fp32", beta="fp32", seed="i64", layer="i32",
)  # fmt: skip
_CONSTANTS = dict(
    NUM_KV_HEADS=4, KV_GROUP=7, BLOCK_H=8, BLOCK_N=64, HEAD_DIM=128, GROUP_SIZE=32, DITHER_BITS=8, V_DITHER=False,
    HAS_OUTLIERS=False, OUTLIERS_PAD=4, NUM_OUTLIERS=4, NUM_SPLITS=8, INTERPRETED=False, HAS_SKIP=False,
    OFFSETS_64=False,
)  # fmt: skip


def compile_stage1(kernels_path: Path, certificate: bool, v_dither: bool, num_stages: int = 2) -> str:
    """The PTX of ``_decode_stage1`` from the module at ``kernels_path``."""
    spec = importlib.util.spec_from_file_location(f"counted_{abs(hash(kernels_path))}", kernels_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel = module._decode_stage1
    constants = dict(_CONSTANTS, CERTIFICATE=certificate, V_DITHER=v_dither)
    signature = {**{k: "*" + t for k, t in _POINTERS.items()}, **_SCALARS, **{k: "constexpr" for k in constants}}
    index = kernel.arg_names.index
    aligned = {(index(k),): [["tt.divisibility", 16]] for k in signature if k in _POINTERS or k.startswith("stride")}
    source = ASTSource(
        fn=kernel, signature=signature, constexprs={(index(k),): v for k, v in constants.items()}, attrs=aligned
    )
    return triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": num_stages}
    ).asm["ptx"]


def count(ptx: str) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """Opcode counts over the whole kernel and inside the token loop (LLVM marks its header)."""
    total: collections.Counter[str] = collections.Counter()
    loop: collections.Counter[str] = collections.Counter()
    lines = ptx.splitlines()
    # LLVM comments the loop header's label; the label may sit on the line before the comment.
    header = next(i for i, line in enumerate(lines) if "Inner Loop Header" in line)
    header = header if lines[header].startswith("$") else header - 1
    label = lines[header].split(":")[0]
    back_edge = max(i for i, line in enumerate(lines) if " bra" in line and line.rstrip().endswith(f"{label};"))
    for i, line in enumerate(lines):
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        opcode = match.group(1)
        total[opcode] += 1
        if header < i <= back_edge:
            loop[opcode] += 1
    return total, loop


def _summary(ops: collections.Counter[str]) -> str:
    def kind(prefix: str) -> int:
        return sum(n for op, n in ops.items() if op.startswith(prefix))

    return (
        f"{sum(ops.values()):5d} (mma {kind('mma'):3d}, cvt {kind('cvt'):3d}, shfl {kind('shfl'):3d}, "
        f"st.shared {kind('st.shared'):3d}, ld.shared {kind('ld.shared'):3d})"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kernels", nargs="+", type=Path, help="copies of kernels/triton_kernels.py to compare")
    parser.add_argument("--v-dither", action="store_true", help="count the dithered-V variant")
    parser.add_argument("--top", type=int, default=0, help="also list the N most frequent loop opcodes")
    parser.add_argument(
        "--num-stages", type=int, default=2, help="pipeline stages (2: the launch config; 3: Triton's default)"
    )
    args = parser.parse_args(argv)
    print(
        f"Triton {triton.__version__}, sm_90, BLOCK_N 64, {args.num_stages} stages, "
        f"V dither {'on' if args.v_dither else 'off'}",
        flush=True,
    )
    for path in args.kernels:
        for certificate in (True, False):
            total, loop = count(compile_stage1(path, certificate, args.v_dither, args.num_stages))
            tag = "certificate" if certificate else "no certificate"
            print(f"{path} [{tag}]\n  total {_summary(total)}\n  loop  {_summary(loop)}")
            if args.top:
                print("  " + ", ".join(f"{op} {n}" for op, n in loop.most_common(args.top)))


if __name__ == "__main__":
    sys.exit(main())
