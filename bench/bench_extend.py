"""Extend (prefill over a quantized prefix) on one GPU: each path of extend_attention against fp16 SDPA.

Method: Qwen2.5-7B shape (28 query heads, 4 KV heads, head_dim 128), one layer, ``B`` sequences of ``prefix``
cached tokens and ``new`` new ones each (shape ``BxPREFIX:NEW``), or, for a mixed batch (``Bx~PREFIX:NEW``),
lengths spread evenly from half to 1.5 times those (``sequence_shapes``); K dithered and V rounded to nearest;
without the certificate is what the SGLang backend's extend calls. Each variant is timed in the same process
as the median of CUDA-graph replays (``triton.testing.do_bench_cudagraph``), except the gathered-SDPA ones and
``sdpa_fp16_eager``, timed eagerly (``triton.testing.do_bench``; without ``bounds`` the gathered-SDPA path
synchronises once per call) in ``--rounds`` interleaved rounds, each variant's median over them and its ratio to
``sdpa_fp16_eager`` paired per round (``over_sdpa_fp16_eager``):

* ``sdpa_fp16``: ``torch.nn.functional.scaled_dot_product_attention`` on contiguous fp16 K/V with the
  bottom-right causal mask (new token ``i`` sees ``prefix + i + 1`` keys), the batch in one call, PyTorch's
  choice of backend; for a mixed batch one ``varlen_attn`` call (FlashAttention 2) instead, its K/V repeated
  per query head outside the timing where PyTorch's varlen has no GQA (``sdpa_fp16_eager``: the same, timed
  eagerly);
* ``gathered_sdpa``: ``extend_attention`` without the certificate as it runs by default on a GPU: K/V
  gathered from the pool in fp16 (``KVPool.gather``), then SDPA per run of equal sequences (``kernels/extend_sdpa.py``);
  ``gathered_sdpa_bounds``: the same given the offsets on the host (``bounds``, an ``ExtendBounds`` made
  once per batch as the SGLang backend does), so without a synchronisation; ``gathered_sdpa_lists``: given them
  as two lists instead, checked on every call; ``per_sequence_bounds`` and ``varlen_bounds``: that with one
  SDPA call per run, and with one ``varlen_attn`` call, whatever the number of runs;
  ``gather``: the gather alone;
* ``tiled``: the exact tiled kernel (``LAUNCH.extend_sdpa = False``, ``LAUNCH.extend_tiled = True``);
* ``per_row``: the same call with ``LAUNCH.extend_tiled = False``: one decode row per new token;
* ``tiled_cert``, ``per_row_cert``: the same two with the certificate of every new token;
* with ``--configs``, ``tiled@R:N:W`` and ``tiled_cert@R:N:W`` for each tiling: ``R`` rows of the dots
  (``LAUNCH.extend_rows``), ``N``-token tiles (``extend_block_n``) and ``W`` warps (``extend_num_warps``).

Writes a JSON results file; prints one line per shape.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from run_info import gpu_run_info
from torch.nn.attention.bias import causal_lower_right
from torch.nn.attention.varlen import varlen_attn

from witcert.kernels import ExtendBounds, KVPool, extend_attention
from witcert.kernels.launch import LAUNCH

Q_HEADS, KV_HEADS, HEAD_DIM = 28, 4, 128


@dataclass
class Batch:
    """One layer's extend batch: the pool with every sequence's K/V written, the fp16 K/V themselves (for the
    baseline), the new tokens' queries and the SGLang-style offsets."""

    pool: KVPool
    k: torch.Tensor
    v: torch.Tensor
    q: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    slots: torch.Tensor
    prefixes: list[int]
    news: list[int]
    totals: list[int]

    @property
    def bounds(self) -> tuple[list[int], list[int]]:
        return self.qo_indptr.tolist(), self.kv_indptr.tolist()


def make_batch(prefix: int, new: int, sequences: int = 1, mixed: bool = False) -> Batch:
    prefixes, news = sequence_shapes(prefix, new, sequences, mixed)
    totals = [p + n for p, n in zip(prefixes, news, strict=True)]
    generator = torch.Generator(device="cuda").manual_seed(prefix + new)
    pool = KVPool(sum(totals), 1, KV_HEADS, HEAD_DIM, device="cuda")
    k = torch.randn(sum(totals), KV_HEADS, HEAD_DIM, device="cuda", generator=generator).half()
    v = torch.randn(sum(totals), KV_HEADS, HEAD_DIM, device="cuda", generator=generator).half()
    pool.write(0, torch.arange(sum(totals), device="cuda"), k, v, validate=False)
    q = torch.randn(sum(news), Q_HEADS, HEAD_DIM, device="cuda", generator=generator).half()
    qo_indptr = torch.tensor([0, *itertools.accumulate(news)], device="cuda", dtype=torch.int32)
    kv_indptr = torch.tensor([0, *itertools.accumulate(totals)], device="cuda", dtype=torch.int32)
    slots = torch.arange(sum(totals), device="cuda", dtype=torch.int32)
    return Batch(pool, k, v, q, qo_indptr, kv_indptr, slots, prefixes, news, totals)


def parse_shape(shape: str) -> tuple[int, int, int, bool]:
    """``[Bx][~]PREFIX:NEW`` -> (prefix, new, sequences, mixed)."""
    sequences, _, pair = shape.rpartition("x")
    prefix, new = (int(x) for x in pair.removeprefix("~").split(":"))
    return prefix, new, int(sequences or 1), pair.startswith("~")


def bench_shape(
    prefix: int,
    new: int,
    per_row: bool,
    configs: list[tuple[int, int, int]],
    sequences: int = 1,
    only: tuple[str, ...] | list[str] = (),
    mixed: bool = False,
    rounds: int = 5,
) -> dict:
    batch = make_batch(prefix, new, sequences, mixed)
    pool, k, v, q = batch.pool, batch.k, batch.v, batch.q
    qo_indptr, kv_indptr, slots, news, totals = batch.qo_indptr, batch.kv_indptr, batch.slots, batch.news, batch.totals
    out = torch.empty(sum(news), Q_HEADS, HEAD_DIM, device="cuda")
    if mixed:
        # What an engine's ragged prefill over an fp16 cache runs: one FlashAttention varlen call, with K/V
        # repeated per query head beforehand (outside the timing) where this PyTorch's varlen has no GQA.
        native_gqa = "enable_gqa" in inspect.signature(varlen_attn).parameters
        group = 1 if native_gqa else Q_HEADS // KV_HEADS
        k_fp16, v_fp16 = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        gqa = {"enable_gqa": True} if native_gqa else {}
        lengths = (max(news), max(totals))
    else:
        # SDPA batches the equal-length sequences: [B, H, new, D] against [B, H_kv, total, D].
        q_sdpa = q.view(sequences, new, Q_HEADS, HEAD_DIM).transpose(1, 2)
        k_sdpa = k.view(sequences, prefix + new, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v_sdpa = v.view(sequences, prefix + new, KV_HEADS, HEAD_DIM).transpose(1, 2)
        mask = causal_lower_right(new, prefix + new)
    row: dict = {"sequences": sequences, "prefix": batch.prefixes, "new": news}

    # Made once per batch, as the SGLang backend does; `lists` variants pass the two lists, checked per call.
    listed = batch.bounds  # read back once, here
    bounds = ExtendBounds(*listed)

    def extend(
        tiled: bool,
        certificate: bool = False,
        config: tuple[int, int, int] | None = None,
        gathered: bool = False,
        host: bool = False,
        max_calls: int | None = None,
        lists: bool = False,
    ):
        settings = {"extend_tiled": tiled, "extend_sdpa": gathered}
        if max_calls is not None:
            settings["extend_sdpa_max_calls"] = max_calls
        if config is not None:
            settings.update(zip(("extend_rows", "extend_block_n", "extend_num_warps"), config, strict=True))

        def run() -> None:
            saved = {name: getattr(LAUNCH, name) for name in settings}
            try:
                for name, value in settings.items():
                    setattr(LAUNCH, name, value)
                # As the SGLang backend calls it: the gathered-SDPA path then returns SDPA's fp16 output as it is.
                extend_attention(
                    q, pool, 0, qo_indptr, kv_indptr, slots, delta_step=1e-8, certificate=certificate,
                    out=None if gathered else out, bounds=(listed if lists else bounds) if host else None,
                )  # fmt: skip
            finally:
                for name, value in saved.items():
                    setattr(LAUNCH, name, value)

        return run

    def sdpa() -> None:
        if mixed:
            varlen_attn(q, k_fp16, v_fp16, qo_indptr, kv_indptr, *lengths, window_size=(-1, 0), **gqa)
        else:
            torch.nn.functional.scaled_dot_product_attention(q_sdpa, k_sdpa, v_sdpa, attn_mask=mask, enable_gqa=True)

    def gather() -> None:
        pool.gather(0, slots)

    variants = [("sdpa_fp16", sdpa), ("gather", gather), ("tiled", extend(True)), ("tiled_cert", extend(True, True))]
    if per_row:
        variants += [("per_row", extend(False)), ("per_row_cert", extend(False, True))]
    for config in configs:
        tag = ":".join(map(str, config))
        variants += [(f"tiled@{tag}", extend(True, False, config)), (f"tiled_cert@{tag}", extend(True, True, config))]
    # The gathered-SDPA path reads offsets on the host (one sync per call), so it cannot be captured in a graph:
    # it is timed eagerly, as SGLang runs prefill, beside SDPA timed the same way.
    eager = [
        ("gathered_sdpa", extend(True, gathered=True)),
        ("gathered_sdpa_bounds", extend(True, gathered=True, host=True)),
        ("gathered_sdpa_lists", extend(True, gathered=True, host=True, lists=True)),
    ]
    eager += [
        ("sdpa_fp16_eager", sdpa),
        ("per_sequence_bounds", extend(True, gathered=True, host=True, max_calls=2**30)),
        ("varlen_bounds", extend(True, gathered=True, host=True, max_calls=0)),
    ]
    for name, fn in variants:
        if not only or name in only:
            row[name] = _timed(lambda fn=fn: triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))
    row.update(_eager_rounds([(name, fn) for name, fn in eager if not only or name in only], rounds))
    return row


def _timed(measure) -> dict:
    """``{"ms": ...}``, or the error: a backend refusing a shape is a result to report."""
    try:
        return {"ms": float(measure())}
    except Exception as error:
        return {"error": f"{type(error).__name__}: {str(error)[:200]}"}


def _eager_rounds(timed: list[tuple[str, object]], rounds: int) -> dict:
    """Host-bound calls drift by about 0.1 ms between runs, so each round times every eager variant once, in
    turn: a variant's ``ms`` is the median over rounds, ``rounds_ms`` every round's, and ``over_sdpa_fp16_eager``
    the median of its per-round ratio to the eager fp16 baseline (paired within each round)."""
    results: dict = {name: {"rounds_ms": []} for name, _ in timed}
    for _ in range(rounds):
        for name, fn in timed:
            result = _timed(lambda fn=fn: triton.testing.do_bench(fn, rep=40, return_mode="median"))
            if "error" in result:
                results[name] = result
            elif "rounds_ms" in results[name]:
                results[name]["rounds_ms"].append(result["ms"])
    baseline = results.get("sdpa_fp16_eager", {}).get("rounds_ms")
    for result in results.values():
        if "rounds_ms" not in result:
            continue
        result["ms"] = statistics.median(result["rounds_ms"])
        if baseline:
            result["over_sdpa_fp16_eager"] = statistics.median(
                a / b for a, b in zip(result["rounds_ms"], baseline, strict=True)
            )
    return results


def sequence_shapes(prefix: int, new: int, sequences: int, mixed: bool) -> tuple[list[int], list[int]]:
    """Each sequence's prefix and new tokens: all ``(prefix, new)``, or for a mixed batch spread evenly from
    half to one and a half times each (the longest prompts with the shortest prefixes), the same totals."""
    if not mixed or sequences == 1:
        return [prefix] * sequences, [new] * sequences
    spread = [0.5 + b / (sequences - 1) for b in range(sequences)]
    return [round(prefix * (2 - f)) for f in spread], [max(1, round(new * f)) for f in spread]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+",
                        default=["16384:512", "0:4096", "32768:128", "0:16384", "2x8192:512", "4x0:2048", "8x4096:256",
                                 "16x0:512", "64x0:128"],
                        help="[Bx][~]PREFIX:NEW: B sequences (default 1) of PREFIX cached and NEW new tokens; "
                             "with ~ spread from half to 1.5 times those (default: %(default)s)")  # fmt: skip
    parser.add_argument("--per-row-up-to", type=int, default=2**26,
                        help="time the per-row path only where B * new * (prefix + new) is at most this")  # fmt: skip
    parser.add_argument("--configs", nargs="*", default=[],
                        help="ROWS:BLOCK_N:WARPS tilings of the tiled kernel to time too (default: none)")  # fmt: skip
    parser.add_argument("--variants", nargs="*", default=[], help="time only these variants (default: all)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds of the eagerly timed variants, each timing all in turn (default: 5)")  # fmt: skip
    parser.add_argument("--output", type=Path, default=Path("bench/results/extend_h200.json"))
    args = parser.parse_args()
    try:
        configs = [tuple(int(x) for x in config.split(":")) for config in args.configs]
    except ValueError:
        parser.error(f"--configs takes ROWS:BLOCK_N:WARPS integers, got {args.configs}")
    if any(len(config) != 3 for config in configs):
        parser.error(f"--configs takes ROWS:BLOCK_N:WARPS, got {args.configs}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    results = {
        "method": __doc__,
        **gpu_run_info(),
        "launch": dict(LAUNCH.__dict__),
        "rows": [],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes:
        prefix, new, sequences, mixed = parse_shape(shape)
        per_row = sequences * new * (prefix + new) <= args.per_row_up_to
        row = bench_shape(prefix, new, per_row, configs, sequences, args.variants, mixed, args.rounds)
        results["rows"].append(row)
        times = " ".join(f"{k}={v.get('ms', float('nan')):.4f}ms" for k, v in row.items() if isinstance(v, dict))
        print(f"{shape}: {times}", flush=True)
        args.output.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
