"""Summarise Nsight Compute's per-instruction warp-stall samples: the share of each stall reason, and per opcode.

Input: the SASS source page of an ``ncu`` report exported as CSV (``bench/profile_decode.py``'s docstring
has both commands), e.g. ``ncu -i stage1.ncu-rep --page source --csv --print-source sass > stage1_sass.csv``,
then ``python bench/ncu_stalls.py stage1_sass.csv`` (gzipped CSVs are read as they are). The stall shares
in docs/KERNELS.md come from this, on ``bench/results/ncu_stage1_cert_s3.csv.gz`` (session 3's kernel, 128
registers) and ``bench/results/ncu_stage1_cert_pipelined.csv.gz`` (pipelined, no cap), B = 32, S = 16k.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
from pathlib import Path


def summarise(path: Path, top: int) -> str:
    opened = gzip.open(path, "rt", newline="") if path.suffix == ".gz" else path.open(newline="")
    with opened as file:
        reader = csv.reader(file)
        next(reader)  # the kernel's name
        header = next(reader)
        rows = [dict(zip(header, row, strict=False)) for row in reader]
    reasons = [name for name in header if name.startswith("stall_") and "Not Issued" not in name]
    if not rows or not reasons:
        raise SystemExit(f"{path}: no per-instruction stall columns (export with --page source --print-source sass)")
    by_reason: collections.Counter[str] = collections.Counter()
    by_opcode: collections.Counter[str] = collections.Counter()
    for row in rows:
        words = [w for w in row["Source"].split() if not w.startswith("@")]
        opcode = words[0].split(".")[0] if words else "?"
        samples = int(row["Warp Stall Sampling (All Samples)"] or 0)
        by_opcode[opcode] += samples
        for reason in reasons:
            by_reason[reason] += int(row[reason] or 0)
    total = sum(by_reason.values()) or 1
    lines = [f"{sum(by_opcode.values())} samples"]
    lines += [f"{reason:26s} {100 * count / total:5.1f}%" for reason, count in by_reason.most_common() if count]
    lines += ["by opcode:"] + [f"{op:10s} {100 * n / total:5.1f}%" for op, n in by_opcode.most_common(top)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", type=Path, help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--top", type=int, default=12, help="opcodes to list")
    args = parser.parse_args()
    print(summarise(args.csv, args.top))


if __name__ == "__main__":
    main()
