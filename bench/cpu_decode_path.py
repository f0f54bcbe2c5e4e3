"""The CPU decode path (the torch reference, as the demo and the tests run it): time per layer call.

For SmolLM2's attention shape (3 KV heads, 9 query heads, head_dim 64, two exact RoPE pairs), one thread:
``decode_attention`` over ``S`` tokens for ``B`` rows, and one ``KVPool.write`` of ``B`` tokens. Median of
``--repeats`` calls. Prints one line per shape.

    python bench/cpu_decode_path.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TRITON_INTERPRET", "0")

import torch  # noqa: E402

from witcert.kernels import KVPool, decode_attention  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for tokens, rows in ((128, 1), (2048, 1), (512, 4)):
        pool = KVPool(rows * tokens, 2, 3, 64, device="cpu", seed=1, outlier_channels=torch.tensor([3, 35, 7, 39]))
        k = torch.randn(rows * tokens, 3, 64).half()
        pool.write(0, torch.arange(rows * tokens), k, torch.randn_like(k))
        q = torch.randn(rows, 9, 64).half()
        indptr, indices = torch.arange(rows + 1) * tokens, torch.arange(rows * tokens)
        decode, write = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            decode_attention(q, pool, 0, indptr, indices, delta_step=1e-7)
            decode.append(time.perf_counter() - start)
            start = time.perf_counter()
            pool.write(1, torch.arange(rows), k[:rows], k[:rows])
            write.append(time.perf_counter() - start)
        print(
            f"S={tokens} B={rows}: decode {1e3 * statistics.median(decode):.2f} ms, "
            f"write {1e3 * statistics.median(write):.2f} ms per layer call"
        )


if __name__ == "__main__":
    main()
