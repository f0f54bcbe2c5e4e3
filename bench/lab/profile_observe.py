"""Where observe mode's host time goes: decode steps of ``bench/bench_e2e.py``'s model under cProfile, per mode.

The transformers loop is host-bound (eager Python issues every kernel; the GPU waits), so observe's cost over off
is host time. For each mode (``off``; ``certificate``: the kernel computes certificates, nobody reads them;
``observe``: with a ``CertificateAggregator`` behind the per-step report) this times ``--steps`` decode steps
between CUDA events (median ms per step, ``--rounds`` interleaved rounds), then runs as many steps under cProfile
and lists each Python function's own time per step (``tottime``, file and function name, no line numbers, so two
checkouts compare) and the functions whose time differs most from ``off``. cProfile's own overhead inflates
every Python call, so its per-function figures rank; the timed steps measure.

    python bench/lab/profile_observe.py --out observe_profile.json     # on the GPU machine
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_e2e import ARCHS, _sync, build_model, time_decode, witcert_cache  # noqa: E402

from witcert.integrations.gating import GateMode  # noqa: E402
from witcert.integrations.transformers_cache import cache_kwarg  # noqa: E402

MODES = {
    "off": (GateMode.OFF, "none"),
    "certificate": (GateMode.OBSERVE, "none"),
    "observe": (GateMode.OBSERVE, "aggregator"),
}


def _key(filename: str, function: str) -> str:
    parts = Path(filename).parts
    return f"{'/'.join(parts[-2:])}:{function}" if len(parts) > 1 else f"{filename}:{function}"


def profiled_steps(model, prompt: torch.Tensor, make, steps: int) -> dict[str, dict[str, float]]:
    """Own time (ms) and calls per decode step of every Python function, over ``steps`` steps under cProfile."""
    cache, per_step = make(prompt.shape[1] + steps + 8)
    kwarg = {cache_kwarg(model): cache}
    with torch.no_grad():
        token = model(input_ids=prompt, use_cache=True, logits_to_keep=1, **kwarg).logits[:, -1].argmax(-1)[:, None]
        for _ in range(3):
            token = model(input_ids=token, use_cache=True, **kwarg).logits[:, -1].argmax(-1)[:, None]
        _sync(prompt.device)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            token = model(input_ids=token, use_cache=True, **kwarg).logits[:, -1].argmax(-1)[:, None]
            if per_step:
                per_step()
        profiler.disable()
        _sync(prompt.device)
    table: dict[str, dict[str, float]] = {}
    for (filename, _, function), (_, calls, tottime, _, _) in pstats.Stats(profiler).stats.items():
        entry = table.setdefault(_key(filename, function), {"ms": 0.0, "calls": 0.0})
        entry["ms"] += 1e3 * tottime / steps
        entry["calls"] += calls / steps
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=sorted(ARCHS), default="smollm2")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the plumbing only
    model = build_model(args.arch, device, torch.float16 if device.type == "cuda" else torch.float32)
    prompt = torch.randint(
        0, model.config.vocab_size, (args.batch, args.context), generator=torch.Generator().manual_seed(1)
    ).to(device)
    makers = {
        name: witcert_cache(model, mode, 0.05, device, observer=observer) for name, (mode, observer) in MODES.items()
    }
    report: dict = {
        "method": __doc__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "arch": args.arch,
        "batch": args.batch,
        "context": args.context,
        "steps": args.steps,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "ms_per_step": {name: [] for name in MODES},
        "host_ms_per_step": {name: [] for name in MODES},
    }
    for _ in range(args.rounds):
        for name, make in makers.items():
            result = time_decode(model, prompt, make, steps=args.steps, warmup=3, budget_s=30.0)
            report["ms_per_step"][name].append(result["ms_per_step"])
            report["host_ms_per_step"][name].append(result["host_ms_per_step"])
    medians = {name: statistics.median(values) for name, values in report["ms_per_step"].items()}
    report["median_ms_per_step"] = medians
    report["over_off"] = {name: medians[name] / medians["off"] - 1 for name in MODES}
    tables = {name: profiled_steps(model, prompt, make, args.steps) for name, make in makers.items()}
    report["profiled_ms_per_step"] = {name: sum(e["ms"] for e in table.values()) for name, table in tables.items()}
    report["top"] = {
        name: sorted(({"function": k, **v} for k, v in table.items()), key=lambda e: -e["ms"])[: args.top]
        for name, table in tables.items()
    }
    report["over_off_by_function"] = {}
    for name in ("certificate", "observe"):
        keys = set(tables[name]) | set(tables["off"])
        empty = {"ms": 0.0, "calls": 0.0}
        rows = [
            {
                "function": k,
                "ms": tables[name].get(k, empty)["ms"] - tables["off"].get(k, empty)["ms"],
                "calls": tables[name].get(k, empty)["calls"] - tables["off"].get(k, empty)["calls"],
            }
            for k in keys
        ]
        report["over_off_by_function"][name] = sorted(rows, key=lambda e: -abs(e["ms"]))[: args.top]
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{report['device']}, {args.arch} batch {args.batch} context {args.context}, {args.steps} steps")
    for name in MODES:
        print(
            f"{name}: {' / '.join(format(v, '.2f') for v in report['ms_per_step'][name])} ms per step, "
            f"{report['over_off'][name]:+.1%} over off; under cProfile {report['profiled_ms_per_step'][name]:.2f} ms"
        )
    for name in ("certificate", "observe"):
        print(f"\n{name} over off, by function (ms per step under cProfile, calls per step):")
        for row in report["over_off_by_function"][name][:15]:
            print(f"  {row['ms']:+8.3f} {row['calls']:+8.1f}  {row['function']}")


if __name__ == "__main__":
    main()
