"""How tight is each member of the bound family against the exact worst case (corner enumeration)?

Usage: python bench/bound_family.py [--cases 6000] [--seed 7]
Prints the certificate's and T1's ratio to the exact worst case, over cases whose worst case is above
1e-9 (below, float64 cancellation in the enumeration dominates), and how often T4, P and PA beat T1.
"""

from __future__ import annotations

import argparse
import json

import torch

from witcert.kernels import reference
from witcert.kernels.soundness import random_bound_cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=6000)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    probs, radius = random_bound_cases(args.cases, torch.Generator().manual_seed(args.seed))
    worst = reference.worst_case_tv(probs, radius)
    terms = reference.accumulate_certificate(probs, radius).terms
    resolvable = worst > 1e-9
    report = {"cases": args.cases, "resolvable": int(resolvable.sum())}
    for name, bound in (("certificate", terms.certificate), ("t1", terms.t1)):
        ratio = bound[resolvable] / worst[resolvable]
        report[name] = {"min": float(ratio.min()), "median": float(ratio.median()), "max": float(ratio.max())}
    report["beats_t1"] = {name: int((getattr(terms, name) < terms.t1).sum()) for name in ("t4", "p", "pa")}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
