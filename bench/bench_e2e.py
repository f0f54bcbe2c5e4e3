"""End-to-end decode through transformers on one GPU: fp16 against witcert off / observe / gate, and what observe
costs over off.

Model. The architecture of SmolLM2-135M-Instruct (the demo's model: Llama, 30 layers, 9 query / 3 KV heads,
head_dim 64, hidden 576, vocab 49152, RoPE theta 1e5) with **random weights** (``random_model``): the trained
weights (540 MB as float32) do not travel to the device machine, and step time does not depend on the values
(gate mode's repairs do: its fallback counts here describe random weights, not the trained model). ``--arch
llama8`` is the 8-layer, 32 / 8 heads, head_dim 128 random model (the breakdown runs both). fp16.

Decode table. For every batch (``--batches``), context (``--contexts``) and mode: the prompt is prefilled (logits
of the last position only), ``--warmup`` greedy steps run (Triton compiles), then ``--steps`` steps are timed one
by one between CUDA events (median ms per step; tokens/s = batch / median). Modes: ``fp16`` is transformers'
``StaticCache`` (preallocated to the context plus the steps) with SDPA, the fair baseline: ``DynamicCache``
concatenates K/V at every step and flatters any other cache; ``off`` the witcert int8 pool without
certificates; ``observe`` with certificates and a ``CertificateAggregator`` (stride 32); ``gate`` also repairs
every head above ``--tau``. No CUDA graphs and no ``torch.compile`` in any mode: the loop is eager
transformers, whose Python is part of every figure. A mode is cut at ``--budget-s`` of timed steps.

Observe's cost over off, broken down (``--breakdown BATCH CONTEXT``, default 8 and 4096, for each model of
``--breakdown-arch``, default the 8-layer one and the demo's). Variants, each timed as above (``--breakdown-steps``
steps) in ``--breakdown-rounds`` interleaved rounds, the order rotated each round, so that a drift of the host's
speed (runs of the same variant differ by several percent) spreads over all of them: ``off``; ``certificate`` (the
kernel computes certificates, nobody reads them); ``report`` (plus ``StepReport``'s per-layer bookkeeping, the
kernel writing into its buffer, and one aggregator launch per step); ``stream`` (plus a ``TelemetryStream`` polled
every step, its exporter thread encoding OTLP and discarding it). For each: ms per step, host time per
step (the forward's wall time with no synchronisation: what the CPU spends issuing it), host-device syncs per
step (counted by ``torch.cuda.set_sync_debug_mode``), and CUDA allocations per step (``memory_stats``); a variant's
cost over off is the median over rounds of its time over off's in the same round. The profiler's top operations of
``off`` and ``stream`` go to ``--profile-dir``.

Run (one device call, about 5 minutes on an H100/H200):

    python bench/bench_e2e.py --out $OUT/e2e.json --profile-dir $OUT

A CPU run with ``--arch tiny --batches 1 --contexts 64 --steps 2`` checks the plumbing only.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

from witcert.integrations.gating import CachePolicy, GateMode
from witcert.integrations.telemetry import CertificateAggregator
from witcert.integrations.telemetry.exporter import EngineIdentity, TelemetryStream
from witcert.integrations.transformers_cache import WitcertCache, cache_kwarg, use_witcert_attention

ARCHS = {
    # name: (layers, hidden, q heads, kv heads, head_dim, intermediate, vocab, rope theta)
    "smollm2": (30, 576, 9, 3, 64, 1536, 49152, 1e5),
    "llama8": (8, 4096, 32, 8, 128, 8192, 32000, 1e4),
    "tiny": (2, 128, 4, 2, 32, 256, 512, 1e4),
}


def build_model(arch: str, device: torch.device, dtype: torch.dtype):
    """A randomly initialised model of ``arch``'s shape (init std ``1.6 / sqrt(hidden)``, as ``random_model``)."""
    layers, hidden, q_heads, kv_heads, head_dim, intermediate, vocab, theta = ARCHS[arch]
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=q_heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": theta}, tie_word_embeddings=arch == "smollm2",
        initializer_range=1.6 / hidden**0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model = model.to(dtype=dtype).eval()
    use_witcert_attention(model)
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DiscardingExporter(MetricExporter):
    """An OTLP metric exporter that encodes each batch as the OTLP/HTTP one does, then drops it: the stream's
    thread does its work, nothing goes on the wire."""

    def __init__(self) -> None:
        super().__init__()
        self.batches = 0

    def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        encode_metrics(metrics_data).SerializeToString()
        self.batches += 1
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        return None


def time_decode(
    model,
    prompt: torch.Tensor,
    make_cache: Callable[[int], tuple[object, Callable[[], None] | None]],
    *,
    steps: int,
    warmup: int,
    budget_s: float,
    count_syncs: bool = False,
) -> dict:
    """Prefill, warm up, then time ``steps`` decode steps one by one."""
    device = prompt.device
    cache, per_step = make_cache(prompt.shape[1] + warmup + steps + 1)
    kwarg = {cache_kwarg(model): cache}
    cuda = device.type == "cuda"
    with torch.no_grad():
        logits = model(input_ids=prompt, use_cache=True, logits_to_keep=1, **kwarg).logits[:, -1]
        token = logits.argmax(-1, keepdim=True)
        warm_start = time.perf_counter()
        for _ in range(warmup):
            if time.perf_counter() - warm_start > budget_s:  # a repair-bound mode: its first steps are the figure
                break
            token = model(input_ids=token, use_cache=True, **kwarg).logits[:, -1].argmax(-1, keepdim=True)
            if per_step:
                per_step()
        _sync(device)
        step_ms, host_ms = [], []
        allocations = torch.cuda.memory_stats(device).get("allocation.all.allocated", 0) if cuda else 0
        syncs = 0
        started = time.perf_counter()
        for _ in range(steps):
            if time.perf_counter() - started > budget_s:
                break
            begin = torch.cuda.Event(enable_timing=True) if cuda else None
            end = torch.cuda.Event(enable_timing=True) if cuda else None
            if cuda:
                begin.record()
            host = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                if count_syncs and cuda:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    logits = model(input_ids=token, use_cache=True, **kwarg).logits[:, -1]
                    token = logits.argmax(-1, keepdim=True)
                    if per_step:
                        per_step()
                finally:
                    if count_syncs and cuda:
                        torch.cuda.set_sync_debug_mode("default")
            host_ms.append(1e3 * (time.perf_counter() - host))
            syncs += sum("synchroniz" in str(w.message) for w in caught)
            if cuda:
                end.record()
                end.synchronize()
                step_ms.append(begin.elapsed_time(end))
            else:
                step_ms.append(host_ms[-1])
        timed = len(step_ms)
        if cuda:
            allocations = torch.cuda.memory_stats(device).get("allocation.all.allocated", 0) - allocations
    median = statistics.median(step_ms)
    result = {
        "steps_timed": timed,
        "ms_per_step": median,
        "ms_per_step_mean": statistics.fmean(step_ms),
        "tokens_per_s": prompt.shape[0] * 1e3 / median,
        "host_ms_per_step": statistics.median(host_ms),
        "allocations_per_step": allocations / timed if cuda else None,
    }
    if count_syncs:
        result["syncs_per_step"] = syncs / timed
    if isinstance(cache, WitcertCache):
        result["fallbacks"] = int(cache.fallback_total)
        result["repaired_bytes"] = int(cache.repaired_bytes_total)
        result["kv_bytes_per_token"] = cache.bytes_per_token
    return result


def witcert_cache(model, mode: GateMode, tau: float, device, *, observer: str = "aggregator"):
    """A maker of witcert caches; ``observer``: ``none``, ``aggregator`` or ``stream`` (aggregator + exporter)."""
    config = model.config

    def make(max_len: int):
        aggregator = stream = None
        if mode is not GateMode.OFF and observer != "none":
            aggregator = CertificateAggregator(
                config.num_hidden_layers, config.num_attention_heads, tau=tau, stride=32, device=device
            )
        if observer == "stream" and aggregator is not None:
            identity = EngineIdentity(model="bench", engine="transformers")
            stream = TelemetryStream(aggregator, DiscardingExporter(), identity, flush_steps=64, flush_seconds=1.0)
        cache = WitcertCache(
            config, CachePolicy(mode=mode, tau=tau, seed=0), max_cache_len=max_len, observer=aggregator
        )
        make.streams.append(stream)
        return cache, (stream.poll if stream is not None else None)

    make.streams = []
    return make


def fp16_static(model, batch: int, device, dtype):
    def make(max_len: int):
        return StaticCache(config=model.config, max_cache_len=max_len), None

    return make


def profile_step(model, prompt, make_cache, path: Path, steps: int = 8) -> None:
    from torch.profiler import ProfilerActivity, profile

    cache, per_step = make_cache(prompt.shape[1] + steps + 4)
    kwarg = {cache_kwarg(model): cache}
    with torch.no_grad():
        token = (
            model(input_ids=prompt, use_cache=True, logits_to_keep=1, **kwarg).logits[:, -1].argmax(-1, keepdim=True)
        )
        for _ in range(2):
            token = model(input_ids=token, use_cache=True, **kwarg).logits[:, -1].argmax(-1, keepdim=True)
        _sync(prompt.device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if prompt.is_cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                token = model(input_ids=token, use_cache=True, **kwarg).logits[:, -1].argmax(-1, keepdim=True)
                if per_step:
                    per_step()
            _sync(prompt.device)
    sort = "self_cuda_time_total" if prompt.is_cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=30)
    cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    path.write_text(f"{steps} decode steps\n\nby device time\n{table}\n\nby host time\n{cpu}\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=sorted(ARCHS), default="smollm2")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8000])
    parser.add_argument("--modes", nargs="+", default=["fp16", "off", "observe", "gate"])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=5.0, help="cap on each mode's timed steps")
    parser.add_argument("--tau", type=float, default=0.05)
    parser.add_argument("--breakdown", type=int, nargs=2, default=[8, 4096], metavar=("BATCH", "CONTEXT"))
    parser.add_argument("--breakdown-arch", choices=sorted(ARCHS), nargs="+", default=["llama8", "smollm2"])
    parser.add_argument("--breakdown-rounds", type=int, default=8)
    parser.add_argument("--breakdown-steps", type=int, default=32)
    parser.add_argument("--no-breakdown", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench/results/e2e.json"))
    parser.add_argument("--profile-dir", type=Path, default=None)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    report: dict = {
        "method": __doc__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "arch": args.arch,
        "weights": "random (the architecture of the named model; see method)",
        "tau": args.tau,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "decode": [],
        "breakdown": [],
        "errors": [],
    }

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")

    # The breakdown first: it is the figure a cut-short run must not lose.
    for arch in [] if args.no_breakdown else args.breakdown_arch:
        batch, context = args.breakdown
        bmodel = build_model(arch, device, dtype)
        prompt = torch.randint(
            0, bmodel.config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(1)
        ).to(device)
        variants = {
            "off": witcert_cache(bmodel, GateMode.OFF, args.tau, device),
            "certificate": witcert_cache(bmodel, GateMode.OBSERVE, args.tau, device, observer="none"),
            "report": witcert_cache(bmodel, GateMode.OBSERVE, args.tau, device, observer="aggregator"),
            "stream": witcert_cache(bmodel, GateMode.OBSERVE, args.tau, device, observer="stream"),
        }
        names = list(variants)
        breakdown = {"arch": arch, "batch": batch, "context": context, "variants": {name: [] for name in names}}
        report["breakdown"].append(breakdown)
        for round_ in range(args.breakdown_rounds):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                make = variants[name]
                try:
                    result = time_decode(
                        bmodel, prompt, make, steps=args.breakdown_steps, warmup=args.warmup,
                        budget_s=args.budget_s, count_syncs=True,
                    )  # fmt: skip
                except Exception:
                    report["errors"].append(f"breakdown {arch} {name}: {traceback.format_exc()}")
                    result = None
                for stream in make.streams:
                    if stream is not None:
                        stream.close()
                make.streams.clear()
                breakdown["variants"][name].append(result)
        rounds = [r for r in zip(*breakdown["variants"].values(), strict=True) if None not in r]
        breakdown["over_off"] = {
            name: statistics.median(r[index]["ms_per_step"] / r[0]["ms_per_step"] - 1 for r in rounds)
            for index, name in enumerate(names)
            if rounds
        }
        print(f"breakdown {arch}: {json.dumps(breakdown['over_off'])}", flush=True)
        save()
        if args.profile_dir is not None:
            args.profile_dir.mkdir(parents=True, exist_ok=True)
            for name in ("off", "stream"):
                try:
                    profile_step(bmodel, prompt, variants[name], args.profile_dir / f"e2e_profile_{arch}_{name}.txt")
                except Exception:
                    report["errors"].append(f"profile {arch} {name}: {traceback.format_exc()}")
            save()
        del bmodel, variants
        if device.type == "cuda":
            torch.cuda.empty_cache()

    model = build_model(args.arch, device, dtype)
    vocab = model.config.vocab_size
    for context in args.contexts:
        for batch in args.batches:
            prompt = torch.randint(0, vocab, (batch, context), generator=torch.Generator().manual_seed(0)).to(device)
            makers = {"fp16": fp16_static(model, batch, device, dtype)}
            makers.update({m.value: witcert_cache(model, m, args.tau, device) for m in GateMode})
            for name in args.modes:
                row = {"batch": batch, "context": context, "mode": name}
                try:
                    row |= time_decode(
                        model, prompt, makers[name], steps=args.steps, warmup=args.warmup, budget_s=args.budget_s
                    )
                except Exception:  # one failing cell must not lose the others
                    report["errors"].append(f"{name} B={batch} S={context}: {traceback.format_exc()}")
                    row["error"] = True
                report["decode"].append(row)
                print(json.dumps(row), flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            save()

    print_tables(report)
    return 1 if report["errors"] else 0


def print_tables(report: dict) -> None:
    print(f"\n{report['device']}, {report['arch']} (random weights), torch {report['torch']}")
    print("| batch | context | mode | ms/step | tokens/s | vs fp16 | fallbacks |")
    print("|---|---|---|---|---|---|---|")
    base = {
        (r["batch"], r["context"]): r["ms_per_step"]
        for r in report["decode"]
        if r["mode"] == "fp16" and "error" not in r
    }
    for r in report["decode"]:
        if "error" in r:
            print(f"| {r['batch']} | {r['context']} | {r['mode']} | error | | | |")
            continue
        ref = base.get((r["batch"], r["context"]))
        versus = f"{r['ms_per_step'] / ref - 1:+.1%}" if ref else ""
        print(
            f"| {r['batch']} | {r['context']} | {r['mode']} | {r['ms_per_step']:.2f} | {r['tokens_per_s']:.0f} "
            f"| {versus} | {r.get('fallbacks', '')} |"
        )
    for breakdown in report["breakdown"]:
        variants = breakdown["variants"]
        print(f"\nobserve over off, {breakdown['arch']} batch {breakdown['batch']} context {breakdown['context']}")
        print("| variant | ms/step (median of rounds) | over off (median of rounds) | host ms/step | syncs/step | "
              "allocations/step |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for name, rounds in variants.items():
            done = [r for r in rounds if r is not None]
            if not done:
                continue
            print(
                f"| {name} | {statistics.median(r['ms_per_step'] for r in done):.3f} "
                f"| {breakdown.get('over_off', {}).get(name, float('nan')):+.1%} "
                f"| {statistics.median(r['host_ms_per_step'] for r in done):.3f} "
                f"| {done[-1].get('syncs_per_step')} | {done[-1].get('allocations_per_step')} |"
            )
    for error in report["errors"]:
        print(error)


if __name__ == "__main__":
    sys.exit(main())
