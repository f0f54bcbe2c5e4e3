"""What the ``blockradius`` contract change (``whatif_stage1.py``) would cost in tightness, on a trained model.

``blockradius`` gives every token of a 32-token block the largest radius of the block, the held-apart token too:
the certificate's per-token ``g`` and radius-weighted sums become one per block, weighted by the block's summed
softmax weights. Every bound of THEORY.md section 3 is increasing in every radius, so the certificate stays sound
(it holds on the same event ``|d_t| <= u_t``); the question is how much looser it gets, and how many heads that
pushes past ``tau`` into a fallback.

Method. SmolLM2-135M-Instruct on CPU, teacher-forced as ``bench/quality_table.py`` runs it (same texts, the prompt
prefilled on exact K/V, then ``--steps`` forced decode steps through a witcert cache in observe mode). Every decode
call of the reference path is intercepted where it accumulates the certificate: its softmax weights and per-token
radii give the certificate as the kernels compute it and, from the same weights, with each radius replaced by
its block's largest (blocks of ``--block`` consecutive tokens from the sequence's start, as a warp's 32 tokens of a
tile are when the split starts at a multiple of 128). The true TV (exact keys against the keys read, float64)
checks that neither is ever below it.

    python bench/lab/block_radius_tightness.py --out bench/results/block_radius_tightness_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "0")  # the torch reference path, which the interception reads

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from witcert.integrations.calibrate import tokenize_texts  # noqa: E402
from witcert.integrations.gating import CachePolicy, GateMode  # noqa: E402
from witcert.integrations.models import load_trained  # noqa: E402
from witcert.integrations.quality import HeadAudit  # noqa: E402
from witcert.integrations.transformers_cache import WitcertCache, cache_kwarg, use_witcert_attention  # noqa: E402
from witcert.kernels import reference  # noqa: E402

TEXTS = {"GPL-3": Path("/usr/share/common-licenses/GPL-3"), "argparse.py": Path(os.__file__).parent / "argparse.py"}
CASES = [("GPL-3", 1024), ("argparse.py", 2048), ("GPL-3", 4096), ("argparse.py", 8184)]
TAUS = (0.01, 0.05, 0.1, 0.2)


def block_max(radius: torch.Tensor, block: int) -> torch.Tensor:
    """Each radius ``[..., S]`` replaced by the largest of its block of ``block`` consecutive tokens."""
    length = radius.shape[-1]
    padded = torch.nn.functional.pad(radius, (0, -length % block), value=0.0)
    maxima = padded.unflatten(-1, (-1, block)).amax(-1, keepdim=True).expand(*padded.shape[:-1], -1, block)
    return maxima.flatten(-2)[..., :length]


class Interception:
    """Wraps ``reference.accumulate_certificate``: returns what it returns, and records the certificate again with
    block-maximum radii for every block size asked for."""

    def __init__(self, blocks: list[int]) -> None:
        self.blocks = blocks
        self.per_token: list[torch.Tensor] = []
        self.per_block: dict[int, list[torch.Tensor]] = {b: [] for b in blocks}
        self.held_exact: dict[int, list[torch.Tensor]] = {b: [] for b in blocks}
        self._original = reference.accumulate_certificate

    def __call__(self, probs: torch.Tensor, radius: torch.Tensor, held: torch.Tensor | None = None):
        accumulators = self._original(probs, radius, held)
        self.per_token.append(accumulators.certificate.double())
        argmax = (probs.argmax(-1) if held is None else held.to(torch.int64))[..., None]
        for b in self.blocks:
            looser = block_max(radius, b)
            self.per_block[b].append(self._original(probs, looser, held).certificate.double())
            looser = looser.scatter(-1, argmax, radius.gather(-1, argmax))
            self.held_exact[b].append(self._original(probs, looser, held).certificate.double())
        return accumulators

    def __enter__(self) -> Interception:
        reference.accumulate_certificate = self
        return self

    def __exit__(self, *exc) -> None:
        reference.accumulate_certificate = self._original


def run_case(model, prompt: torch.Tensor, forced: torch.Tensor, policy: CachePolicy, blocks: list[int]) -> dict:
    kwarg = cache_kwarg(model)
    exact = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prompt, use_cache=True, **{kwarg: exact})
    audit = HeadAudit()
    cache = WitcertCache(
        model.config, policy, max_cache_len=prompt.shape[1] + forced.shape[1], keep_exact=True, audit=audit
    )
    for layer_index, layer in enumerate(exact.layers):
        cache.update(layer.keys.clone(), layer.values.clone(), layer_index)
    with Interception(blocks) as seen, torch.no_grad():
        for t in range(forced.shape[1]):
            model(input_ids=forced[:, t : t + 1], use_cache=True, **{kwarg: cache})
    # One reference call per (layer, row); the audit has one [B = 1, H_q] entry per layer call, in the same order.
    per_token = torch.stack(seen.per_token).flatten()
    audited = torch.stack(audit.certificate).flatten()
    if not torch.allclose(per_token, audited, rtol=1e-6, atol=0):
        raise SystemExit("the intercepted certificates are not the ones the cache reported: the interception is off")
    return {
        "true_tv": torch.stack(audit.true_tv).flatten().tolist(),
        "per_token": per_token.tolist(),
        "per_block": {str(b): torch.stack(v).flatten().tolist() for b, v in seen.per_block.items()},
        "held_exact": {str(b): torch.stack(v).flatten().tolist() for b, v in seen.held_exact.items()},
    }


def summary(cases: list[dict], blocks: list[int]) -> dict:
    tv = torch.tensor([x for c in cases for x in c["true_tv"]], dtype=torch.float64)
    exact = torch.tensor([x for c in cases for x in c["per_token"]], dtype=torch.float64)
    out = {"certificates": tv.numel(), "per_token": _figures(exact, tv, exact)}
    for b in blocks:
        looser = torch.tensor([x for c in cases for x in c["per_block"][str(b)]], dtype=torch.float64)
        out[f"block_{b}"] = _figures(looser, tv, exact)
        looser = torch.tensor([x for c in cases for x in c["held_exact"][str(b)]], dtype=torch.float64)
        out[f"block_{b}_held_exact"] = _figures(looser, tv, exact)
    return out


def _figures(cert: torch.Tensor, tv: torch.Tensor, exact: torch.Tensor) -> dict:
    finite = torch.isfinite(cert) & torch.isfinite(exact) & (exact > 0)
    ratio = cert[finite] / exact[finite]
    return {
        "violations": int((tv > cert).sum()),
        "coverage": {str(tau): float((cert <= tau).double().mean()) for tau in TAUS},
        "median": float(cert.median()),
        "ratio_to_per_token": {q: float(ratio.quantile(float(q))) for q in ("0.5", "0.9", "0.99", "1.0")},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="results file (JSON)")
    parser.add_argument("--steps", type=int, default=8, help="forced decode steps per case (default 8)")
    parser.add_argument("--block", type=int, nargs="+", default=[32, 128], help="block sizes (default 32 128)")
    parser.add_argument(
        "--outliers", type=Path, default=Path("bench/results/outliers/smollm2_calibrated_m4.json"),
        help="outlier pairs kept exact (default: the 4 calibrated pairs); 'none' for none",
    )  # fmt: skip
    parser.add_argument("--cases", type=int, default=len(CASES), help=f"the first N of {CASES}")
    args = parser.parse_args()

    model, tokenizer = load_trained()
    use_witcert_attention(model)
    outliers = None if str(args.outliers) == "none" else args.outliers
    policy = CachePolicy(mode=GateMode.OBSERVE, outlier_file=outliers)
    cases = []
    for name, context in CASES[: args.cases]:
        started = time.monotonic()
        ((_, tokens),) = tokenize_texts(tokenizer, [TEXTS[name]], context + args.steps)
        prompt, forced = tokens[:, :context], tokens[:, context : context + args.steps]
        result = run_case(model, prompt, forced, policy, args.block)
        cases.append({"text": name, "context": context, **result})
        print(f"{name} {context}: {len(result['true_tv'])} certificates, {time.monotonic() - started:.0f} s",
              file=sys.stderr)  # fmt: skip
    result = {
        "method": __doc__.split("\n\n")[2],
        "outliers": str(outliers),
        "steps": args.steps,
        "summary": summary(cases, args.block),
        "cases": [{k: v for k, v in c.items() if k in ("text", "context")} for c in cases],
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    return 0 if all(v["violations"] == 0 for k, v in result["summary"].items() if k != "certificates") else 1


if __name__ == "__main__":
    sys.exit(main())
