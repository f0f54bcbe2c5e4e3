"""The quality table on a trained model and real text, teacher-forced (docs/QUALITY.md).

Method. A trained model (``--model``, ``witcert.integrations.models``: SmolLM2-135M-Instruct, the default, or Gemma 3
270M, whose sliding-window layers read their last 512 tokens), float32 on CPU. Texts nobody here wrote: the
GPL-3 licence Debian ships and Python standard-library sources (``argparse.py``); outlier pairs are calibrated on
other texts (``witcert calibrate``'s defaults: the Apache-2.0 licence and ``textwrap.py``), so no evaluation text
is seen by the calibration. For each (text, context): the first ``context`` tokens are the prompt, the text's own
next ``--steps`` tokens are forced one at a time. The prompt is run once with transformers' unquantized cache;
its K/V are written into a fresh ``WitcertCache`` for every configuration (prefill attends on exact K/V, so
this is what a prefill through the witcert cache writes), and the forced steps run through each cache.

Per configuration (``m`` = 0, 2, 4, 8, 16 exact RoPE pairs, calibrated or lowest-frequency): observe mode gives
every (layer, query head, step) certificate with its true TV (``HeadAudit``: the exact keys against the keys the
decode read, float64), KL(p_ref || p_witcert) and top-1 agreement of the next-token distributions; gate mode at
``--gate-tau`` gives the fallbacks and bytes paged in (and its own violations, KL and top-1). The reference is the
unquantized cache in the model's float32 (the witcert pool holds K/V as fp16).

Results are written after every (text, context) to ``--out`` (gzipped JSON: every head's certificate and true
TV, to four significant digits rounded up); a rerun skips the cases it holds; ``--markdown`` prints the tables.

    python bench/quality_table.py --out bench/results/quality_smollm2.json.gz
    python bench/quality_table.py --out bench/results/quality_smollm2.json.gz --markdown
    python bench/quality_table.py --model gemma-3-270m --pairs 0 4 --out bench/results/quality_gemma3_270m.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import platform
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "0")  # the torch reference path: the interpreter is far slower

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from witcert.integrations.calibrate import calibrate, default_texts, tokenize_texts  # noqa: E402
from witcert.integrations.gating import CachePolicy, GateMode  # noqa: E402
from witcert.integrations.models import GEMMA3_270M, SMOLLM2, load_trained, model_spec  # noqa: E402
from witcert.integrations.quality import HeadAudit  # noqa: E402
from witcert.integrations.transformers_cache import WitcertCache, cache_kwarg, use_witcert_attention  # noqa: E402
from witcert.kernels.outliers import OutlierFile  # noqa: E402

TAUS = (0.01, 0.05, 0.1, 0.2)
PAIRS = (0, 2, 4, 8, 16)
# Each model's prefix in the names of its results and outlier files.
PREFIX = {SMOLLM2.name: "smollm2", GEMMA3_270M.name: "gemma3_270m"}
STDLIB = Path(sysconfig.get_paths()["stdlib"])
# (text, context) in the order they run: the longest contexts of both texts first, so a run cut short still
# covers 512 to 8k.
CASES = [
    ("argparse.py", 8184),
    ("GPL-3", 4096),
    ("argparse.py", 2048),
    ("GPL-3", 512),
    ("argparse.py", 512),
    ("GPL-3", 1024),
    ("argparse.py", 4096),
    ("GPL-3", 2048),
    ("argparse.py", 1024),
    ("GPL-3", 7640),
]
TEXTS = {"GPL-3": Path("/usr/share/common-licenses/GPL-3"), "argparse.py": STDLIB / "argparse.py"}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def _rounded(values: torch.Tensor) -> list[float]:
    """Four significant digits, rounded up (a certificate stays an upper bound; a TV rounds up too, so a
    violation is never hidden by the rounding): what the results file keeps of each head."""
    out = []
    for x in values.tolist():
        if x == 0 or not math.isfinite(x):
            out.append(x)
            continue
        step = 10.0 ** (math.floor(math.log10(abs(x))) - 3)
        out.append(float(f"{math.ceil(x / step) * step:.4g}"))
    return out


def step_log_probs(model, cache, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token log-probabilities ``[T, V]`` after each forced token of ``tokens`` ``[1, T]``."""
    kwarg = cache_kwarg(model)
    out = []
    with torch.no_grad():
        for t in range(tokens.shape[1]):
            logits = model(input_ids=tokens[:, t : t + 1], use_cache=True, **{kwarg: cache}).logits
            out.append(torch.log_softmax(logits[0, -1].double(), dim=-1))
    return torch.stack(out)


def run_case(model, prompt: torch.Tensor, forced: torch.Tensor, configs: dict, gate_tau: float, log) -> dict:
    """Every configuration on one (prompt, forced tokens): raw per-head certificates and true TVs, KL, top-1."""
    # Every layer keeps all its K/V (no config: no sliding-window layer drops the oldest), so the witcert caches get
    # the whole prompt; the masks still give each sliding layer its window.
    reference_cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=prompt, use_cache=True, **{cache_kwarg(model): reference_cache})
    prefill = [(layer.keys.clone(), layer.values.clone()) for layer in reference_cache.layers]
    reference_lp = step_log_probs(model, reference_cache, forced)
    results = {}
    for name, (outlier_file, mode) in configs.items():
        started = time.monotonic()
        policy = CachePolicy(mode=mode, tau=gate_tau, outlier_file=outlier_file)  # a fresh random seed each
        audit = HeadAudit()
        cache = WitcertCache(
            model.config, policy, max_cache_len=prompt.shape[1] + forced.shape[1], keep_exact=True, audit=audit
        )
        for layer, (k, v) in enumerate(prefill):
            cache.update(k, v, layer)
        witcert_lp = step_log_probs(model, cache, forced)
        kl = (reference_lp.exp() * (reference_lp - witcert_lp)).sum(-1)
        results[name] = {
            "mode": str(mode),
            "certificate": _rounded(torch.stack(audit.certificate).flatten()),
            "true_tv": _rounded(torch.stack(audit.true_tv).flatten()),
            "kl": kl.tolist(),
            "top1": (reference_lp.argmax(-1) == witcert_lp.argmax(-1)).tolist(),
            "fallbacks": int(cache.fallback_total),
            "repaired_bytes": int(cache.repaired_bytes_total),
            "seconds": round(time.monotonic() - started, 1),
        }
        log(f"  {name}: {results[name]['seconds']} s, fallbacks {results[name]['fallbacks']}")
    return results


def calibrated_files(model, tokenizer, name: str, pairs: list[int], directory: Path, log) -> dict[int, Path]:
    """Outlier files for every m of ``pairs``, calibrated once at the largest m (greedy choices nest)."""
    largest = max(pairs)
    paths = {m: directory / f"{PREFIX[name]}_calibrated_m{m}.json" for m in pairs if m}
    if all(p.is_file() for p in paths.values()):
        return paths
    log(f"calibrating m = {largest} on {', '.join(str(p) for p in default_texts())}")
    texts = tokenize_texts(tokenizer, default_texts(), 2048)
    result = calibrate(model, texts, largest, model_name=name)
    for m, path in paths.items():
        OutlierFile(
            model=name,
            num_layers=result.outliers.num_layers,
            num_kv_heads=result.outliers.num_kv_heads,
            head_dim=result.outliers.head_dim,
            pairs=result.order[..., :m],
            # The scores recorded by the calibration are those of m = largest: not kept in the smaller files.
            calibration={k: v for k, v in result.outliers.calibration.items() if not k.startswith("mean_certificate")}
            | {"nested_from_m": largest},
        ).save(path)
    value_error = directory / f"{PREFIX[name]}_calibration_value_error.json"
    value_error.write_text(json.dumps(result.value_error, indent=1) + "\n")
    return paths


def lowest_files(model, name: str, pairs: list[int], directory: Path) -> dict[int, Path]:
    config = model.config
    paths = {}
    for m in pairs:
        if m:
            paths[m] = OutlierFile.lowest_frequency(
                name, config.num_hidden_layers, config.num_key_value_heads, config.head_dim, m
            ).save(directory / f"{PREFIX[name]}_lowest_m{m}.json")
    return paths


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(cases: list[dict], config: str) -> dict:
    cert, tv, kl, top1 = [], [], [], []
    fallbacks = repaired = 0
    for case in cases:
        r = case["results"].get(config)
        if r is None:
            continue
        cert += r["certificate"]
        tv += r["true_tv"]
        kl += r["kl"]
        top1 += r["top1"]
        fallbacks += r["fallbacks"]
        repaired += r["repaired_bytes"]
    ratios = [c / t for c, t in zip(cert, tv, strict=True) if t > 0 and math.isfinite(c)]
    return {
        "certificates": len(cert),
        "violations": sum(t > c for c, t in zip(cert, tv, strict=True)),
        "coverage": {str(tau): sum(c <= tau for c in cert) / len(cert) if cert else math.nan for tau in TAUS},
        "ratio_median": _quantile(ratios, 0.5),
        "ratio_p90": _quantile(ratios, 0.9),
        "kl_mean": sum(kl) / len(kl) if kl else math.nan,
        "top1": sum(top1) / len(top1) if top1 else math.nan,
        "fallbacks": fallbacks,
        "repaired_bytes": repaired,
    }


def markdown(data: dict) -> str:
    cases = data["cases"]
    lines = [
        "Cases run (text, context + forced steps): "
        + ", ".join(f"{c['text']} {c['context']}+{c['steps']}" for c in cases),
        "",
        "| m | pairs | violations / certificates | coverage 0.01 / 0.05 / 0.1 / 0.2 | cert/TV median | p90 | KL mean "
        f"| top-1 | gate tau {data['gate_tau']}: fallbacks | repaired bytes | gate violations | gate KL |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in data.get("pairs", PAIRS):
        for method in ("calibrated", "lowest") if m else ("none",):
            observe = summarize(cases, f"m{m}-{method}-observe")
            gate = summarize(cases, f"m{m}-{method}-gate")
            coverage = " / ".join(f"{observe['coverage'][str(t)]:.3f}" for t in TAUS)
            lines.append(
                f"| {m} | {method} | {observe['violations']} / {observe['certificates']} | {coverage} "
                f"| {observe['ratio_median']:.2f} | {observe['ratio_p90']:.2f} | {observe['kl_mean']:.2e} "
                f"| {observe['top1']:.3f} | {gate['fallbacks']} | {gate['repaired_bytes']:,} "
                f"| {gate['violations']} / {gate['certificates']} | {gate['kl_mean']:.2e} |"
            )
    lines += ["", "Coverage at tau 0.2 and median certificate / true TV by context (observe, all texts):", ""]
    contexts = sorted({c["context"] for c in cases})
    lines.append("| m | pairs | " + " | ".join(str(c) for c in contexts) + " |")
    lines.append("|---|---|" + "---|" * len(contexts))
    for m in data.get("pairs", PAIRS):
        for method in ("calibrated", "lowest") if m else ("none",):
            cells = []
            for context in contexts:
                s = summarize([c for c in cases if c["context"] == context], f"m{m}-{method}-observe")
                cells.append(f"{s['coverage']['0.2']:.3f} ({s['ratio_median']:.1f}x)")
            lines.append(f"| {m} | {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=SMOLLM2.name, help="trained model (default %(default)s)")
    parser.add_argument(
        "--pairs", type=int, nargs="+", default=list(PAIRS), metavar="M",
        help="exact RoPE pairs per configuration, calibrated and lowest-frequency (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, help="results file (default bench/results/quality_<model>.json.gz)")
    parser.add_argument("--steps", type=int, default=8, help="forced decode steps per case (default 8)")
    parser.add_argument("--gate-tau", type=float, default=0.05)
    parser.add_argument("--cases", type=int, default=len(CASES), help="run the first N cases of CASES")
    parser.add_argument("--markdown", action="store_true", help="print the tables from --out and exit")
    args = parser.parse_args()
    spec = model_spec(args.model)
    if 0 not in args.pairs or any(m < 0 for m in args.pairs):
        parser.error("--pairs lists m >= 0 and includes 0 (the configuration without exact channels)")
    args.out = args.out or Path(f"bench/results/quality_{PREFIX[spec.name]}.json.gz")
    if args.markdown:
        with gzip.open(args.out, "rt") as stream:
            print(markdown(json.load(stream)))
        return 0

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)

    torch.manual_seed(0)
    model, tokenizer = load_trained(spec)
    use_witcert_attention(model)
    files_dir = args.out.parent / "outliers"
    pairs = sorted(set(args.pairs))
    calibrated = calibrated_files(model, tokenizer, spec.name, pairs, files_dir, log) if pairs[-1] else {}
    lowest = lowest_files(model, spec.name, pairs, files_dir)
    configs = {}
    for mode in (GateMode.OBSERVE, GateMode.GATE):
        configs[f"m0-none-{mode}"] = (None, mode)
        for m in pairs[1:]:
            configs[f"m{m}-calibrated-{mode}"] = (calibrated[m], mode)
            configs[f"m{m}-lowest-{mode}"] = (lowest[m], mode)

    data = None
    if args.out.is_file():
        with gzip.open(args.out, "rt") as stream:
            data = json.load(stream)
    same = data is not None and data.get("model") == spec.name and data.get("pairs", list(PAIRS)) == pairs
    if not same or data.get("steps") != args.steps or data.get("gate_tau") != args.gate_tau:
        data = {
            "model": spec.name,
            "pairs": pairs,
            "steps": args.steps,
            "gate_tau": args.gate_tau,
            "commit": _commit(),
            "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}",
            "cases": [],
        }
    done = {(c["text"], c["context"]) for c in data["cases"]}
    tokens = {name: tokenize_texts(tokenizer, [path], 10**9)[0][1] for name, path in TEXTS.items()}
    for text, context in CASES[: args.cases]:
        if (text, context) in done:
            continue
        ids = tokens[text]
        if ids.shape[1] < context + args.steps:
            log(f"skip {text} {context}: only {ids.shape[1]} tokens")
            continue
        log(f"{text}: context {context}, {args.steps} forced steps, {len(configs)} configurations")
        started = time.monotonic()
        results = run_case(model, ids[:, :context], ids[:, context : context + args.steps], configs, args.gate_tau, log)
        data["cases"].append(
            {"text": text, "context": context, "steps": args.steps, "seconds": round(time.monotonic() - started),
             "results": results}
        )  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(args.out, "wt") as stream:
            json.dump(data, stream)
        log(f"{text} {context} done in {time.monotonic() - started:.0f} s")
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
