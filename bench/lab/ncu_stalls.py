"""Summarise Nsight Compute's per-instruction warp-stall samples: the share of each stall reason, and per opcode.

Also the share of long-scoreboard samples spent waiting to overwrite a register that an asynchronous copy
(``LDGSTS``) issued just before still has to read as its address (``copy_address_waits``).

Input: the SASS source page of an ``ncu`` report exported as CSV (``bench/lab/profile_decode.py``'s docstring
has both commands), e.g. ``ncu -i stage1.ncu-rep --page source --csv --print-source sass > stage1_sass.csv``,
then ``python bench/lab/ncu_stalls.py stage1_sass.csv`` (gzipped CSVs are read as they are).

``--by-function {cert,nocert}`` also splits the samples by the source function they come from: the export has
SASS without source lines, so the Gluon stage 1 (fp16 queries, V rounded, with or without the certificate) is
compiled here, its instructions matched with the profiled ones by their longest common runs of opcodes (the profiled
binary is specialised on its launch's arguments), and each matched sample charged to its instruction's line. The
code must be the profiled kernel's: compile with the device's Triton (``PYTHONPATH=/tmp/t36``, ``count_sass.py``'s
docstring), at the same commit; below 90% of the samples matched it stops.
"""

from __future__ import annotations

import argparse
import collections
import csv
import difflib
import gzip
import re
import sys
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


def _opcode(source: str) -> str:
    """An instruction's opcode without its predicate and modifiers: ``@!P1 HMMA.16816.F32 ...`` -> ``HMMA``."""
    words = [w for w in source.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else "?"


def read_rows(path: Path) -> tuple[list[dict[str, str]], list[str]]:
    """The export's per-instruction rows and its stall-reason columns (all samples, not the not-issued ones)."""
    opened = gzip.open(path, "rt", newline="") if path.suffix == ".gz" else path.open(newline="")
    with opened as file:
        reader = csv.reader(file)
        next(reader)  # the kernel's name
        header = next(reader)
        rows = [dict(zip(header, row, strict=False)) for row in reader]
    reasons = [name for name in header if name.startswith("stall_") and "Not Issued" not in name]
    if not rows or not reasons:
        raise SystemExit(f"{path}: no per-instruction stall columns (export with --page source --print-source sass)")
    return rows, reasons


def by_function(rows: list[dict[str, str]], reasons: list[str], certificate: bool, top: int) -> str:
    """The samples per source function of the Gluon stage 1 compiled here, with each function's three largest
    stall reasons (module docstring)."""
    root = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(root / "tests"), str(Path(__file__).parent)]
    from count_sass import enclosing_function
    from sass import compile_cubin, disassemble

    instructions, _ = disassemble(compile_cubin(kernel_name="gluon", certificate=certificate))
    profiled = [_opcode(row["Source"]) for row in rows]
    compiled = [_opcode(mnemonic) for mnemonic, _, _ in instructions]
    # The profiled binary was specialised on its launch's arguments, so the schedules differ in places: instructions
    # are matched by the longest common runs of opcodes, and only matched ones are charged.
    matcher = difflib.SequenceMatcher(None, profiled, compiled, autojunk=False)
    samples: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    total = sum(int(row[reason] or 0) for row in rows for reason in reasons) or 1
    for block in matcher.get_matching_blocks():
        for offset in range(block.size):
            row, (_, _, (path, line)) = rows[block.a + offset], instructions[block.b + offset]
            function = samples[enclosing_function(path, line)]
            for reason in reasons:
                function[reason] += int(row[reason] or 0)
    matched = sum(sum(counts.values()) for counts in samples.values())
    if matched < 0.9 * total:
        raise SystemExit(
            f"only {100 * matched / total:.0f}% of the samples fall on instructions matched with the SASS compiled "
            "here: compile with the device's Triton, at the profiled commit"
        )
    ranked = sorted(samples.items(), key=lambda item: -sum(item[1].values()))[:top]
    lines = [
        f"by source function ({100 * matched / total:.0f}% of the samples matched; each function's share of all "
        "samples and its three largest reasons, as shares of its own samples):"
    ]
    for name, counts in ranked:
        own = sum(counts.values()) or 1
        largest = ", ".join(f"{r.removeprefix('stall_')} {100 * n / own:.0f}%" for r, n in counts.most_common(3) if n)
        lines.append(f"{name:24s} {100 * own / total:5.1f}%  {largest}")
    return "\n".join(lines)


def summarise(rows: list[dict[str, str]], reasons: list[str], top: int) -> str:
    """The samples' shares per stall reason and per opcode, and the copy-address waits."""
    by_reason: collections.Counter[str] = collections.Counter()
    by_opcode: collections.Counter[str] = collections.Counter()
    for row in rows:
        opcode = _opcode(row["Source"])
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
    parser.add_argument("--top", type=int, default=12, help="opcodes (and functions) to list")
    parser.add_argument("--by-function", choices=["cert", "nocert"], help="also the samples per source "
                        "function of the Gluon stage 1 profiled with or without the certificate")  # fmt: skip
    args = parser.parse_args()
    rows, reasons = read_rows(args.csv)
    print(summarise(rows, reasons, args.top))
    if args.by_function:
        print(by_function(rows, reasons, args.by_function == "cert", args.top))


if __name__ == "__main__":
    main()
