"""The Triton decode stage 1 at head dim 256 (Gemma 3 270M: 4 query heads on 1 KV head), by tile size.

``LAUNCH.block_n_wide`` (tokens a tile for heads wider than 128) at 64 and 128, with and without the certificate,
beside cuDNN's SDPA on a contiguous fp16 cache of the same keys, each the median of CUDA-graph replays
(``bench_kernels._median_ms``); every cache is larger than the L2, so its reads come from DRAM. GPU only.

    python bench/lab/wide_heads.py --output bench/results/wide_heads_h100.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_kernels import _median_ms  # noqa: E402
from run_info import gpu_run_info  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from witcert.kernels import KVPool, decode_attention, reference  # noqa: E402
from witcert.kernels.launch import LAUNCH  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM = 4, 1, 256


def bench(batch: int, context: int, dtype: torch.dtype) -> dict:
    tokens = batch * context
    generator = torch.Generator(device="cuda").manual_seed(batch * 7919 + context)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", generator=generator).to(dtype)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, device="cuda", generator=generator).to(dtype)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, device="cuda", generator=generator).to(dtype)
    pool = KVPool(tokens, 1, KV_HEADS, HEAD_DIM, v_dither=False, device="cuda", dtype=dtype)
    pool.write(0, torch.arange(tokens, device="cuda"), k, v, validate=False)
    indptr = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * context
    indices = torch.arange(tokens, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    delta = reference.delta_step(18, Q_HEADS)
    k_sdpa = k.view(batch, context, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    v_sdpa = v.view(batch, context, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    row: dict = {"batch": batch, "context": context, "dtype": str(dtype)}

    def sdpa() -> None:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), k_sdpa, v_sdpa, enable_gqa=True)

    def int8(block_n: int, certificate: bool):
        def run() -> None:
            LAUNCH.block_n_wide = block_n  # read when the graph is captured
            decode_attention(q, pool, 0, indptr, indices, delta_step=delta, out=out, certificate=certificate)

        return run

    variants = [("sdpa_cudnn", sdpa)] + [
        (f"tile{block_n}_{'cert' if cert else 'nocert'}", int8(block_n, cert))
        for block_n in (64, 128)
        for cert in (False, True)
    ]
    default = LAUNCH.block_n_wide
    for name, fn in variants:
        try:
            row[name] = _median_ms(fn)
        except Exception as error:  # a backend refusing a shape is a result to report
            row[name] = f"{type(error).__name__}: {str(error)[:200]}"
    LAUNCH.block_n_wide = default
    print(
        " ".join(f"{key}={value:.4f}" if isinstance(value, float) else f"{key}={value}" for key, value in row.items())
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    rows = [bench(b, s, dtype) for dtype in (torch.bfloat16,) for b, s in ((32, 16384), (8, 16384), (8, 65536))]
    args.output.write_text(json.dumps({"run": gpu_run_info(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
