"""Register cap x number of splits for the Gluon decode stage 1 on one GPU (the H200): a JSON results file.

Method: Qwen2.5-7B decode shape (28 query heads, 4 KV heads, head_dim 128), one layer, contiguous slots.
For each (batch, context) the cuDNN SDPA baseline and each ``[cap, splits]`` pair (``null`` splits: the
default, ``default_num_kv_splits``) are timed in one process as the median of CUDA-graph replays
(``triton.testing.do_bench_cudagraph``), with and without the certificate, twice over (``rep`` 0 and 1).
Inputs rotate among copies so that each call reads at least 512 MB (no L2 hits). The cap decides how many
programs an SM holds (168: three, none: two), the splits how many waves they make.

Example: ``python bench/lab/bench_splits.py --configs '[[168, 3], [null, 2]]' --shapes '[[32, 16384]]'``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from witcert.kernels import KVPool, decode_attention, reference
from witcert.kernels.launch import LAUNCH

Q_HEADS, KV_HEADS, HEAD_DIM = 28, 4, 128


def _median_ms(fn) -> float:
    return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))


def bench_shape(batch: int, context: int, configs: list[list], delta: float) -> list[dict]:
    tokens = batch * context
    copies = max(1, -(-512 * 2**20 // (tokens * KV_HEADS * HEAD_DIM * 4)))
    pool = KVPool(copies * tokens, 1, KV_HEADS, HEAD_DIM, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(batch + context)
    for start in range(0, copies * tokens, 2**20):
        stop = min(start + 2**20, copies * tokens)
        k = torch.randn(stop - start, KV_HEADS, HEAD_DIM, device="cuda", generator=generator).half()
        pool.write(0, torch.arange(start, stop, device="cuda"), k, torch.randn_like(k), validate=False)
    q = [torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", generator=generator).half() for _ in range(copies)]
    indptr = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * context
    indices = [torch.arange(i * tokens, (i + 1) * tokens, device="cuda", dtype=torch.int32) for i in range(copies)]
    k_sdpa = torch.randn(batch, KV_HEADS, context, HEAD_DIM, device="cuda").half()
    v_sdpa = torch.randn_like(k_sdpa)
    out = torch.empty(batch, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.float16)
    counter = {"i": 0}

    def sdpa() -> None:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            torch.nn.functional.scaled_dot_product_attention(q[0].unsqueeze(2), k_sdpa, v_sdpa, enable_gqa=True)

    def gluon(certificate: bool, cap: int | None, splits: int | None):
        def run() -> None:
            LAUNCH.gluon, LAUNCH.gluon_min_tokens = True, 0
            LAUNCH.gluon_maxnreg = LAUNCH.gluon_maxnreg_nocert = cap
            counter["i"] = (counter["i"] + 1) % copies
            i = counter["i"]
            decode_attention(q[i], pool, 0, indptr, indices[i], delta_step=delta, out=out, certificate=certificate,
                             num_kv_splits=splits)  # fmt: skip

        return run

    rows = []
    for rep in range(2):
        cudnn = _median_ms(sdpa)
        for cap, splits in configs:
            row = {"batch": batch, "context": context, "cap": cap, "splits": splits, "rep": rep, "cudnn_ms": cudnn}
            row["cert_ms"] = _median_ms(gluon(True, cap, splits))
            row["nocert_ms"] = _median_ms(gluon(False, cap, splits))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", type=json.loads, default=[[168, None], [None, None]],
                        help="JSON list of [register cap or null, splits or null]")  # fmt: skip
    parser.add_argument("--shapes", type=json.loads, default=[[8, 16384], [32, 16384], [32, 65536]],
                        help="JSON list of [batch, context]")  # fmt: skip
    parser.add_argument("--output", type=Path, default=Path("bench/results/splits_h200.json"))
    args = parser.parse_args()
    delta = reference.delta_step(28, Q_HEADS)
    results = {"method": __doc__, "device": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": []}
    for batch, context in args.shapes:
        results["rows"] += bench_shape(batch, context, args.configs, delta)
        torch.cuda.empty_cache()
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
