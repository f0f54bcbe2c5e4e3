"""Host time of an extend batch's offset checks and SDPA plan, per layer call, on this machine's CPU (no GPU).

What ``ExtendBounds`` saves when an engine makes it once per batch instead of passing two lists, which
``extend_attention`` then checks and plans from on every layer call: the checks (``ExtendBounds(...)``), the
runs of equal sequences and the varlen maxima, for 64 equal and 64 mixed sequences. Median of 7 repeats of
2000 calls each.

    python bench/bench_extend_host.py
"""

from __future__ import annotations

import random
import statistics
import timeit

from witcert.kernels.extend_bounds import ExtendBounds


def main() -> None:
    rng = random.Random(0)
    for name, lengths in (("64 equal", [128] * 64), ("64 mixed", [rng.randint(64, 192) for _ in range(64)])):
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)

        def per_call(offsets: list[int] = offsets) -> None:
            bounds = ExtendBounds(offsets, offsets)
            bounds.runs, bounds.longest  # noqa: B018 (computed and cached: what the SDPA path reads)

        times = timeit.repeat(per_call, number=2000, repeat=7)
        print(f"{name} sequences: {statistics.median(times) / 2000 * 1e6:.1f} us per call")


if __name__ == "__main__":
    main()
