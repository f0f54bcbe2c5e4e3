"""Measure the certificate's soundness by Monte Carlo and write bench/results/soundness.json.

Usage: python bench/soundness.py [--draws 100000] [--head-dim 128] [--out bench/results/soundness.json]
Method: see docs/THEORY.md section 4 and witcert.kernels.soundness.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from witcert.kernels.soundness import run_soundness


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draws", type=int, default=100_000, help="(head, step) draws per key law")
    parser.add_argument("--dither-bits", type=int, default=8, choices=(8, 16, 24))
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128, 256), help="a head's channels")
    parser.add_argument("--out", type=Path, default=Path("bench/results/soundness.json"))
    args = parser.parse_args()
    rows = []
    for law in ("gaussian", "outlier_channels"):
        start = time.perf_counter()
        report = run_soundness(
            draws=args.draws,
            tokens=(512, 1024, 2048, 4096),
            kv_heads=4,
            laws=(law,),
            dither_bits=args.dither_bits,
            head_dim=args.head_dim,
            seed=7,
        )
        rows.append(report.as_dict() | {"law": law, "seconds": round(time.perf_counter() - start, 1)})
        print(json.dumps(rows[-1]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"torch": torch.__version__, "machine": platform.machine(), "results": rows}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
