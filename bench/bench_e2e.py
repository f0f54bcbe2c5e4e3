"""End-to-end benchmark of the transformers integration: decode-step time and teacher-forced quality.

Method. A randomly initialised Llama-style model (no weights are downloadable; ``random_model`` with
init std 0.1) in fp16 on one GPU. For each cache mode the same prompt batch is prefilled, a few decode
steps warm up (Triton compiles), then ``--steps`` greedy decode steps are timed as a whole with
``torch.cuda.synchronize`` around the loop (wall clock: it includes the Python of transformers and of
the cache, which is what a user of this integration pays). Modes: ``fp16`` is transformers'
``DynamicCache`` with SDPA (the baseline); ``off`` is the witcert int8 pool without certificates;
``observe`` adds certificates and the aggregator; ``gate`` adds the check against tau (one device sync
per layer) and repairs. Quality: ``teacher_forced_quality`` on the first sequence, observe and gate,
against the fp16 cache. Writes ``--out`` (JSON) and prints a Markdown table.

Run: ``python bench/bench_e2e.py --out bench/results/e2e_h200.json`` (GPU; a CPU run works with tiny
``--layers/--prompt``, for the plumbing only).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import traceback
from pathlib import Path

import torch
from transformers import DynamicCache

from witcert.integrations.gating import CachePolicy, GateMode
from witcert.integrations.quality import greedy_continuation, random_model, teacher_forced_quality
from witcert.integrations.telemetry import CertificateAggregator
from witcert.integrations.transformers_cache import WitcertCache, cache_kwarg, use_witcert_attention


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_decode(model, prompt: torch.Tensor, make_cache, steps: int, warmup: int, budget_s: float) -> dict:
    cache, aggregator = make_cache()
    kwarg = {cache_kwarg(model): cache}
    with torch.no_grad():
        logits = model(input_ids=prompt, use_cache=True, **kwarg).logits[:, -1]
        for _ in range(warmup):
            logits = model(input_ids=logits.argmax(-1, keepdim=True), use_cache=True, **kwarg).logits[:, -1]
        _sync()
        start = time.perf_counter()
        timed = 0
        # A mode that repairs a lot runs on the torch path: stop it at the budget rather than lose the run.
        while timed < steps and time.perf_counter() - start < budget_s:
            logits = model(input_ids=logits.argmax(-1, keepdim=True), use_cache=True, **kwarg).logits[:, -1]
            timed += 1
        _sync()
        elapsed = time.perf_counter() - start
    result = {
        "steps_timed": timed,
        "ms_per_step": 1e3 * elapsed / timed,
        "tokens_per_s": prompt.shape[0] * timed / elapsed,
    }
    if isinstance(cache, WitcertCache):
        result["kv_bytes_per_token"] = cache.bytes_per_token
        result["fp16_kv_bytes_per_token"] = cache.fp16_bytes_per_token
        result["fallbacks"] = int(cache.fallback_total)
        result["repaired_bytes"] = int(cache.repaired_bytes_total)
    if aggregator is not None:
        snapshot = aggregator.snapshot()
        samples = int(snapshot.samples.sum())
        result["certificates"] = samples
        finite = snapshot.raw_value[snapshot.raw_value == snapshot.raw_value]
        result["raw_sample_quantiles"] = (
            {q: float(torch.tensor(finite).quantile(q)) for q in (0.5, 0.9, 0.99)} if finite.size else {}
        )
        result["covered_fraction"] = int(snapshot.covered.sum()) / samples
        result["vacuous"] = int(snapshot.vacuous.sum())
        result["inf"] = int(snapshot.inf.sum())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=25.0, help="wall-clock cap of each mode's timed loop")
    parser.add_argument("--quality-steps", type=int, default=12)
    parser.add_argument("--tau", type=float, default=0.05)
    parser.add_argument("--out", type=Path, default=Path("bench/results/e2e.json"))
    parser.add_argument(
        "--modes", nargs="+", default=["fp16", *GateMode], help="cache modes to time (fp16 is the baseline)"
    )
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    model = random_model(
        layers=args.layers,
        hidden=args.q_heads * args.head_dim,
        q_heads=args.q_heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        vocab=args.vocab,
        dtype=dtype,
        device=device,
    )
    use_witcert_attention(model)
    prompt = torch.randint(0, args.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0)).to(
        device
    )
    max_len = args.prompt + args.warmup + args.steps + 1
    report: dict = {
        "method": __doc__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "shape": {k: getattr(args, k) for k in ("layers", "q_heads", "kv_heads", "head_dim", "batch", "prompt")},
        "tau": args.tau,
        "decode": {},
        "quality": {},
        "errors": [],
    }

    def witcert(mode: GateMode):
        def make():
            aggregator = None
            if mode is not GateMode.OFF:
                aggregator = CertificateAggregator(args.layers, args.q_heads, tau=args.tau, stride=32, device=device)
            policy = CachePolicy(mode=mode, tau=args.tau)
            return WitcertCache(model.config, policy, max_cache_len=max_len, observer=aggregator), aggregator

        return make

    modes = {"fp16": lambda: (DynamicCache(config=model.config), None)}
    modes.update({mode.value: witcert(mode) for mode in GateMode})
    for name, make in modes.items():
        if name not in args.modes:
            continue
        try:
            report["decode"][name] = time_decode(model, prompt, make, args.steps, args.warmup, args.budget_s)
        except Exception:  # a failing mode must not hide the others' figures
            report["errors"].append(f"decode {name}: {traceback.format_exc()}")
        print(name, report["decode"].get(name), flush=True)
    baseline = report["decode"].get("fp16", {}).get("ms_per_step")
    if baseline:
        for result in report["decode"].values():
            result["overhead_vs_fp16"] = result["ms_per_step"] / baseline - 1

    first = prompt[:1, : min(args.prompt, 1024)]
    continuation = greedy_continuation(model, first, args.quality_steps) if args.quality_steps else None
    for mode in (GateMode.OBSERVE, GateMode.GATE) if args.quality_steps else ():
        try:
            quality = teacher_forced_quality(model, first, continuation, CachePolicy(mode=mode, tau=args.tau))
            report["quality"][mode.value] = quality.as_dict()
        except Exception:
            report["errors"].append(f"quality {mode.value}: {traceback.format_exc()}")
        print(mode.value, report["quality"].get(mode.value), flush=True)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print("\n| mode | ms/step | tokens/s | overhead vs fp16 | fallbacks | covered |")
    print("|---|---|---|---|---|---|")
    for name, r in report["decode"].items():
        print(
            f"| {name} | {r['ms_per_step']:.2f} | {r['tokens_per_s']:.0f} | {r.get('overhead_vs_fp16', 0):+.1%} "
            f"| {r.get('fallbacks', '-')} | {r.get('covered_fraction', '-')} |"
        )
    for error in report["errors"]:
        print(error)


if __name__ == "__main__":
    main()
