"""Summarise Nsight Compute's per-instruction warp-stall samples: the share of each stall reason, and per opcode.

Also the share of long-scoreboard samples spent waiting to overwrite a register that an asynchronous copy
(``LDGSTS``) issued just before still has to read as its address (``copy_address_waits``).

Input: the SASS source page of an ``ncu`` report exported as CSV (``bench/lab/profile_decode.py``'s docstring
has both commands), e.g. ``ncu -i stage1.ncu-rep --page source --csv --print-source sass > stage1_sass.csv``,
then ``python bench/lab/ncu_stalls.py stage1_sass.csv`` (gzipped CSVs are read as they are).
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import re
from pathlib import Path

# An instruction's first operand, the register it writes: "@!P1 IADD3 R94, P5, ..." -> "R94".
_DESTINATION = re.compile(r"(?:@!?U?P\w+\s+)?[A-Z][\w.]*\s+(R\d+)\b")
_COPY_ADDRESS = re.compile(r"\[(R\d+)\.64")
# How far back a write looks for an asynchronous copy that read the register it overwrites.
_WAR_WINDOW = 12


def copy_address_waits(rows: list[dict[str, str]]) -> int:
    """Long-scoreboard samples on instructions that overwrite a register pair an ``LDGSTS`` (``cp.async``) issued
    at most ``_WAR_WINDOW`` instructions before took as its global address: the copy has not read its operands
    yet (the memory pipe's queue is behind), so the write waits. Register pressure makes ptxas reuse them at once."""
    sources = [row["Source"].strip() for row in rows]
    samples = 0
    for i, (row, source) in enumerate(zip(rows, sources, strict=True)):
        waited = int(row.get("stall_long_sb") or 0)
        written = _DESTINATION.match(source)
        if not waited or not written:
            continue
        for earlier in sources[max(0, i - _WAR_WINDOW) : i]:
            address = _COPY_ADDRESS.search(earlier) if "LDGSTS" in earlier else None
            if address and written.group(1) in (address.group(1), f"R{int(address.group(1)[1:]) + 1}"):
                samples += waited
                break
    return samples


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
    war = copy_address_waits(rows)
    lines.append(f"(stall_long_sb of it on overwriting an LDGSTS address register: {100 * war / total:.1f}%)")
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
