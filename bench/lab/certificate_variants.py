"""What cheaper certificates cost in tightness, on a trained model, against per-token sums.

``per_token`` is section 3's sums taken token by token (THEORY.md) with the radius ``c sigma_t + bias_t`` and the
global argmax held apart; ``certificate`` is the product's (``reference.accumulate_certificate``: cells, the end
tiles' argmax, the radius ``(c + kappa) sigma_t`` with one ``kappa`` per head dimension). Every variant is sound: it
bounds each of section 3's accumulators from above, and the bounds only add and multiply them, so the certificate
stays a bound on ``TV(p, p~)`` on the same event ``|d_t| <= u_t``. What each saves in the kernel is the per-token
work of the certificate; what it costs is tightness, measured here. The variants below take the per-token radius
and, for the moments, ``c + kappa`` with ``kappa`` per head (``RadiusParts.c_hat``):

* ``block32``, ``block128`` (``whatif_stage1.py blockradius``): every token of a block of 32 (128) consecutive
  tokens takes the block's largest radius, the held-apart token too; ``..._held`` keeps the held-apart token's own.
  The per-token ``g`` and radius-weighted sums become one per block and head.
* ``moments32``: no per-token radius at all. By Cauchy-Schwarz over the groups, ``u_t = c sigma_t + bias_t <=
  (c + kappa) sigma_t`` with ``kappa^2 = sum_g b_g^2 / a_g`` per head (``bias_t = sum_g b_g s_{t,g}``, ``sigma_t^2
  = sum_g a_g s_{t,g}^2``), so every rest sum follows from the weighted moments ``M_g = sum_t p~_t s_{t,g}^2`` per
  block of 32 tokens, which the tensor cores could compute beside PV (the weights' operand against the scales'
  squares): ``U <= (c + kappa) sum_blocks sqrt(W_blk S_blk)`` (Cauchy-Schwarz over the tokens, ``S_blk = sum_g a_g
  M_g``), ``B <= (c + kappa)^2 sum_blocks h(u_blk) S_blk`` with ``h(x) = g(x) / x^2`` increasing and ``u_blk = (c +
  kappa) sqrt(sum_g a_g max_t s_{t,g}^2)`` the block's largest possible radius, and ``A1 <= U + B``. The held-apart
  token keeps its own radius.
* ``moments_thread``: the same over the tokens one thread of the Gluon stage 1 holds (tokens ``r, r + 8, r + 16, r +
  24`` of a warp's 32), from the per-token ``sigma_t^2`` that the radius' tf32 MMA gives (its bias MMA goes): ``u``
  of a group is ``(c + kappa)`` times its largest ``sigma``, and the held-apart token's radius is ``(c + kappa)
  sigma_m`` too. Per thread and tile that is two square roots and ``h`` per head where the kernel now computes a
  square root, ``g`` and two products per token and head.
* ``no_held``, ``moments_thread_no_held``: no token held apart, so no argmax, no fold and neither T4 nor PA: the
  certificate is ``min(T1, P)`` of the per-token sums (of ``moments_thread``'s bounds), which need no lane exchange
  in the loop.
* ``held_first``, ``moments_thread_held_first``: the sequence's first token held apart, whatever its weight (section
  3 holds for any token held apart): where it is the argmax, as attention sinks are, T4 and PA keep what they win,
  and the loop needs no argmax, only its first tile leaves token 0 out of the sums.
* ``held_ends``, ``moments_thread_held_ends``: held apart, the argmax over the sequence's first and last tiles of
  128 tokens (``ENDS``; tiles start at multiples of 128, as the decode kernels' do): where attention sinks (the start)
  and the newest tokens (the end) sit. A kernel runs the argmax and its fold on those two tiles alone (their start is
  a scalar it knows, so the branch is uniform); every other tile adds all its tokens to the sums. Where the argmax
  lies in neither, another token is held apart, which is sound. With the moments, each 32-token block of an end tile
  gives its own first argmax a cell of its own (a warp holds it apart there, then holds it or folds it back alone),
  so that the sums do not depend on the order a kernel meets the tiles in.

Method. A trained model on CPU (``--model``: SmolLM2-135M-Instruct, or Gemma 3 270M, whose sliding-window layers
read their last 512 tokens), teacher-forced as ``bench/quality_table.py`` runs it (the prompt prefilled on exact
K/V, then ``--steps`` forced decode steps through a witcert cache in observe mode). Every decode call of the
reference path is intercepted where it computes the radii and accumulates the certificate: the same softmax weights
and scales give the certificate as the kernels compute it and each variant's (blocks of consecutive tokens from the
sequence's start, as a warp's 32 tokens of a tile are when the split starts at a multiple of 128). The true TV
(exact keys against the keys read, float64) checks that none is ever below it.

    python bench/lab/certificate_variants.py --out bench/results/certificate_variants_smollm2.json
    python bench/lab/certificate_variants.py --model gemma-3-270m --out bench/results/certificate_variants_gemma3.json
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

from witcert.integrations.calibrate import tokenize_texts  # noqa: E402
from witcert.integrations.gating import CachePolicy, GateMode  # noqa: E402
from witcert.integrations.models import GEMMA3_270M, SMOLLM2, load_trained, model_spec  # noqa: E402
from witcert.integrations.quality import HeadAudit  # noqa: E402
from witcert.integrations.transformers_cache import WitcertCache, cache_kwarg, use_witcert_attention  # noqa: E402
from witcert.kernels import reference  # noqa: E402

TEXTS = {"GPL-3": Path("/usr/share/common-licenses/GPL-3"), "argparse.py": Path(os.__file__).parent / "argparse.py"}
# Each model's outlier pairs, from `witcert calibrate --pairs 4 --model NAME --out FILE`.
CALIBRATED = {
    SMOLLM2.name: Path("bench/results/outliers/smollm2_calibrated_m4.json"),
    GEMMA3_270M.name: Path("bench/results/outliers/gemma3_270m_calibrated_m4.json"),
}
CASES = [("GPL-3", 1024), ("argparse.py", 2048), ("GPL-3", 4096), ("argparse.py", 8184)]
TAUS = (0.01, 0.05, 0.1, 0.2)
# The summary's entries that describe the run rather than a variant.
_FACTS = ("certificates", "kappa_over_c")
VARIANTS = (
    "certificate",
    "block32",
    "block32_held",
    "block128",
    "block128_held",
    "moments32",
    "moments_thread",
    "no_held",
    "moments_thread_no_held",
    "held_first",
    "moments_thread_held_first",
    "held_ends",
    "moments_thread_held_ends",
)
ENDS = 128


def _blocks(x: torch.Tensor, block: int, fill: float = 0.0) -> torch.Tensor:
    """``x`` ``[..., S]`` as ``[..., S / block, block]``, padded with ``fill``."""
    return torch.nn.functional.pad(x, (0, -x.shape[-1] % block), value=fill).unflatten(-1, (-1, block))


def block_max(radius: torch.Tensor, block: int) -> torch.Tensor:
    """Each radius ``[..., S]`` replaced by the largest of its block of ``block`` consecutive tokens."""
    blocks = _blocks(radius, block)
    return blocks.amax(-1, keepdim=True).expand_as(blocks).flatten(-2)[..., : radius.shape[-1]]


def h_of(x: torch.Tensor) -> torch.Tensor:
    """``g(x) / x^2``, increasing in ``x >= 0``, ``1/2`` at 0."""
    return torch.where(x > 0, reference.expm1_minus_x(x) / x.square().clamp_min(1e-300), 0.5)


class RadiusParts:
    """What ``logit_radius`` computes on the way, per query head: ``a_g``, ``b_g``, the tail multiplier ``c`` and
    the scales ``[H_q, S, G]``."""

    def __init__(self, q: torch.Tensor, k: reference.QuantizedKV, sm_scale: float, delta: float,
                 kv_head_of_query: torch.Tensor) -> None:  # fmt: skip
        dtype = q.dtype
        num_q_heads, head_dim = q.shape
        q_masked = q
        if k.outlier_channels.numel():
            mask = torch.ones(k.num_kv_heads, head_dim, dtype=dtype)
            mask.scatter_(-1, k.outlier_channels, 0.0)
            q_masked = q * mask[kv_head_of_query]
        q_groups = q_masked.view(num_q_heads, head_dim // k.group_size, k.group_size).double()
        self.a = sm_scale**2 * q_groups.square().sum(-1) / 12.0  # [H_q, G]
        self.b = sm_scale * q_groups.abs().sum(-1) * reference.fp_slack(k.dither_bits)
        self.c = reference.tail_multiplier(k.num_tokens, delta)
        self.scales = k.scales.double()[:, kv_head_of_query, :].permute(1, 0, 2)  # [H_q, S, G]

    def sigma_sq(self) -> torch.Tensor:
        return (self.scales.square() * self.a[:, None, :]).sum(-1)  # [H_q, S]

    def per_token_radius(self) -> torch.Tensor:
        """``c sigma_t + bias_t`` ``[H_q, S]``: THEORY.md section 2's radius before ``kappa``."""
        return self.c * self.sigma_sq().sqrt() + (self.scales * self.b[:, None, :]).sum(-1)

    def c_hat(self) -> torch.Tensor:
        """``c + kappa``: ``u_t <= c_hat sigma_t`` for every token (Cauchy-Schwarz over the groups)."""
        kappa_sq = torch.where(self.a > 0, self.b.square() / self.a.clamp_min(1e-300), 0.0).sum(-1)
        return self.c + kappa_sq.sqrt()


def _thread_groups(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., S]`` as ``[..., S / 32 * 8, 4]``: per block of 32 tokens, the 8 groups ``r, r + 8, r + 16, r +
    24`` that one thread of a warp holds."""
    blocks = _blocks(x, 32).unflatten(-1, (4, 8)).transpose(-1, -2)  # [..., blocks, r, 4]
    return blocks.flatten(-3, -2)


def block_argmaxes(candidates: torch.Tensor, at_ends: torch.Tensor) -> torch.Tensor:
    """``[..., S]`` bool: the first argmax of each block of 32 tokens in the end tiles (``at_ends``; ``candidates``
    are the weights there, -1 elsewhere), the tokens a kernel's warps hold apart there and hold or fold back alone."""
    num_tokens = candidates.shape[-1]
    blocks = _blocks(candidates, 32, fill=-1.0)  # [..., blocks, 32]
    first = blocks.argmax(-1, keepdim=True)
    picked = torch.zeros_like(blocks, dtype=torch.bool).scatter(-1, first, True)
    in_ends = _blocks(at_ends.expand_as(candidates).to(candidates.dtype), 32) > 0
    return (picked & in_ends).flatten(-2)[..., :num_tokens]


def per_token_accumulators(
    probs: torch.Tensor, radius: torch.Tensor, held: torch.Tensor | None = None
) -> reference.CertificateAccumulators:
    """Section 3's sums token by token, ``held`` ``[...]`` (default: the first argmax of ``probs``) held apart."""
    argmax = probs.argmax(-1, keepdim=True) if held is None else held[..., None].to(torch.int64)
    p_max = probs.gather(-1, argmax).squeeze(-1)
    u_max = radius.gather(-1, argmax).squeeze(-1)
    rest = torch.ones_like(probs, dtype=torch.bool).scatter(-1, argmax, False)
    zero = torch.zeros((), dtype=probs.dtype)
    b_rest = torch.where(rest, reference.mul_nonneg(probs, reference.expm1_minus_x(radius)), zero).sum(-1)
    u_rest = torch.where(rest, reference.mul_nonneg(probs, radius), zero).sum(-1)
    return reference.CertificateAccumulators(u_rest + b_rest, b_rest, u_rest, torch.where(rest, probs, zero).sum(-1),
                                             p_max, u_max)  # fmt: skip


def without_held(terms: reference.CertificateTerms) -> torch.Tensor:
    """``min(T1, P)``: the bounds that hold no token apart (``A1`` and ``B`` are sums over every token)."""
    return torch.minimum(terms.t1, terms.p) * reference.CERTIFICATE_EVAL_SLACK


def moments_certificate(
    probs: torch.Tensor,
    radius: torch.Tensor,
    parts: RadiusParts,
    argmax: torch.Tensor,
    per_thread: bool,
    no_held: bool = False,
    alone: torch.Tensor | None = None,
) -> torch.Tensor:
    """``moments32``'s certificate ``[H_q]``, or ``moments_thread``'s, or its ``min(T1, P)`` (the module's
    docstring). ``alone`` ``[H_q, S]`` (bool, per thread only): tokens that are cells of their own, their terms
    exact for the radius ``(c + kappa) sigma_t``."""
    probs = probs.double()
    rest = probs.scatter(-1, argmax, 0.0)
    c_hat = parts.c_hat()[:, None]
    sigma_sq = parts.sigma_sq()
    if per_thread:
        grouped = rest if alone is None else rest.masked_fill(alone, 0.0)
        weighted = _thread_groups(grouped * sigma_sq).sum(-1)  # S per group [H_q, groups]
        weights = _thread_groups(grouped).sum(-1)  # W per group
        u_blk = c_hat * _thread_groups(sigma_sq).amax(-1).sqrt()
        u_max = c_hat.squeeze(-1) * sigma_sq.gather(-1, argmax).squeeze(-1).sqrt()
    else:
        weighted = _blocks(rest * sigma_sq, 32).sum(-1)  # S_blk [H_q, blocks]
        weights = _blocks(rest, 32).sum(-1)  # W_blk
        largest = (_blocks(parts.scales.square().transpose(1, 2), 32).amax(-1) * parts.a[:, :, None]).sum(1)
        u_blk = c_hat * largest.sqrt()
        u_max = radius.double().gather(-1, argmax).squeeze(-1)
    u_rest = (c_hat * (weights * weighted).sqrt()).sum(-1)
    b_rest = (c_hat.square() * h_of(u_blk) * weighted).sum(-1)
    if alone is not None:
        single = torch.where(alone, rest, 0.0)
        u_single = c_hat * sigma_sq.sqrt()
        u_rest = u_rest + (single * u_single).sum(-1)
        b_rest = b_rest + (single * reference.expm1_minus_x(u_single)).sum(-1)
    p_max = probs.gather(-1, argmax).squeeze(-1)
    terms = reference.certificate_from_accumulators(u_rest + b_rest, b_rest, u_rest, rest.sum(-1), p_max, u_max)
    if no_held:
        return without_held(terms)
    if not bool((radius.double() <= c_hat * sigma_sq.sqrt() * (1 + 1e-6) + 1e-30).all()):
        raise SystemExit("a radius exceeds (c + kappa) sigma: the Cauchy-Schwarz step is off")
    return terms.certificate


class Interception:
    """Wraps ``reference.logit_radius`` (to keep its parts) and ``reference.accumulate_certificate`` (to return what
    it returns, and record the per-token certificate and every variant's beside it)."""

    def __init__(self) -> None:
        self.product: list[torch.Tensor] = []
        self.per_token: list[torch.Tensor] = []
        self.kappa_over_c: list[torch.Tensor] = []
        self.variants: dict[str, list[torch.Tensor]] = {name: [] for name in VARIANTS}
        self._radius = reference.logit_radius
        self._accumulate = reference.accumulate_certificate
        self._parts: RadiusParts | None = None

    def logit_radius(self, q, k, *, sm_scale, delta, kv_head_of_query):
        self._parts = RadiusParts(q, k, sm_scale, delta, kv_head_of_query)
        self.kappa_over_c.append(self._parts.c_hat() / self._parts.c - 1.0)
        return self._radius(q, k, sm_scale=sm_scale, delta=delta, kv_head_of_query=kv_head_of_query)

    def accumulate(self, probs: torch.Tensor, radius: torch.Tensor, exact: torch.Tensor | None = None):
        if exact is not None:
            raise SystemExit("exact tokens in observe mode: the interception covers the quantized tokens alone")
        accumulators = self._accumulate(probs, radius)
        self.product.append(accumulators.certificate.double())
        self.variants["certificate"].append(accumulators.certificate.double())
        # The per-token radius, 0 where the product's is (tokens not read).
        radius = torch.where(radius > 0, self._parts.per_token_radius().to(probs.dtype), 0.0)
        per_token = per_token_accumulators(probs, radius)
        self.per_token.append(per_token.certificate.double())
        argmax = probs.argmax(-1, keepdim=True)
        for block in (32, 128):
            looser = block_max(radius, block)
            self.variants[f"block{block}"].append(per_token_accumulators(probs, looser).certificate.double())
            looser = looser.scatter(-1, argmax, radius.gather(-1, argmax))
            self.variants[f"block{block}_held"].append(per_token_accumulators(probs, looser).certificate.double())
        self.variants["moments32"].append(moments_certificate(probs, radius, self._parts, argmax, False))
        self.variants["moments_thread"].append(moments_certificate(probs, radius, self._parts, argmax, True))
        self.variants["no_held"].append(without_held(per_token.terms).double())
        first = torch.zeros_like(argmax)
        self.variants["held_first"].append(per_token_accumulators(probs, radius, first[..., 0]).certificate.double())
        self.variants["moments_thread_held_first"].append(moments_certificate(probs, radius, self._parts, first, True))
        position = torch.arange(probs.shape[-1])
        at_ends = (position < ENDS) | (position >= (probs.shape[-1] - 1) // ENDS * ENDS)
        candidates = probs.masked_fill(~at_ends, -1.0)
        ends = candidates.argmax(-1, keepdim=True)
        self.variants["held_ends"].append(per_token_accumulators(probs, radius, ends[..., 0]).certificate.double())
        self.variants["moments_thread_held_ends"].append(
            moments_certificate(probs, radius, self._parts, ends, True, alone=block_argmaxes(candidates, at_ends))
        )
        self.variants["moments_thread_no_held"].append(
            moments_certificate(probs, radius, self._parts, argmax, True, no_held=True)
        )
        return accumulators

    def __enter__(self) -> Interception:
        reference.logit_radius = self.logit_radius
        reference.accumulate_certificate = self.accumulate
        return self

    def __exit__(self, *exc) -> None:
        reference.logit_radius = self._radius
        reference.accumulate_certificate = self._accumulate


def run_case(model, prompt: torch.Tensor, forced: torch.Tensor, policy: CachePolicy) -> dict:
    kwarg = cache_kwarg(model)
    audit = HeadAudit()
    cache = WitcertCache(
        model.config, policy, max_cache_len=prompt.shape[1] + forced.shape[1], keep_exact=True, audit=audit
    )
    with torch.no_grad():
        # The prompt attends on the exact K/V it writes; only its last position's logits are kept (a 262k-token
        # vocabulary over 8k positions would take 8 GB).
        model(input_ids=prompt, use_cache=True, logits_to_keep=1, **{kwarg: cache})
    with Interception() as seen, torch.no_grad():
        for t in range(forced.shape[1]):
            model(input_ids=forced[:, t : t + 1], use_cache=True, **{kwarg: cache})
    # One reference call per (layer, row); the audit has one [B = 1, H_q] entry per layer call, in the same order.
    product = torch.stack(seen.product).flatten()
    audited = torch.stack(audit.certificate).flatten()
    if not torch.allclose(product, audited, rtol=1e-6, atol=0):
        raise SystemExit("the intercepted certificates are not the ones the cache reported: the interception is off")
    return {
        "true_tv": torch.stack(audit.true_tv).flatten().tolist(),
        "per_token": torch.stack(seen.per_token).flatten().tolist(),
        "kappa_over_c": torch.cat(seen.kappa_over_c).tolist(),
        "variants": {name: torch.stack(v).flatten().tolist() for name, v in seen.variants.items()},
    }


def _figures(cert: torch.Tensor, tv: torch.Tensor, exact: torch.Tensor) -> dict:
    finite = torch.isfinite(cert) & torch.isfinite(exact) & (exact > 0)
    ratio = cert[finite] / exact[finite]
    return {
        "violations": int((tv > cert).sum()),
        "coverage": {str(tau): float((cert <= tau).double().mean()) for tau in TAUS},
        "median": float(cert.median()),
        "ratio_to_per_token": {q: float(ratio.quantile(float(q))) for q in ("0.5", "0.9", "0.99", "1.0")},
    }


def summary(cases: list[dict]) -> dict:
    def joined(key: str, name: str | None = None) -> torch.Tensor:
        values = [x for c in cases for x in (c[key] if name is None else c[key][name])]
        return torch.tensor(values, dtype=torch.float64)

    tv, exact = joined("true_tv"), joined("per_token")
    kappa = joined("kappa_over_c")
    out = {
        "certificates": tv.numel(),
        "kappa_over_c": {"median": float(kappa.median()), "max": float(kappa.max())},
        "per_token": _figures(exact, tv, exact),
    }
    for name in VARIANTS:
        out[name] = _figures(joined("variants", name), tv, exact)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="results file (JSON)")
    parser.add_argument("--steps", type=int, default=8, help="forced decode steps per case (default 8)")
    parser.add_argument("--model", default=SMOLLM2.name, help="trained model (default %(default)s)")
    parser.add_argument(
        "--outliers", type=Path,
        help="outlier pairs kept exact (default: the model's 4 calibrated pairs, CALIBRATED); 'none' for none",
    )  # fmt: skip
    parser.add_argument("--cases", type=int, default=len(CASES), help=f"the first N of {CASES}")
    args = parser.parse_args()

    spec = model_spec(args.model)
    model, tokenizer = load_trained(spec)
    use_witcert_attention(model)
    outliers = CALIBRATED[spec.name] if args.outliers is None else args.outliers
    outliers = None if str(outliers) == "none" else outliers
    policy = CachePolicy(mode=GateMode.OBSERVE, outlier_file=outliers)
    cases = []
    for name, context in CASES[: args.cases]:
        started = time.monotonic()
        ((_, tokens),) = tokenize_texts(tokenizer, [TEXTS[name]], context + args.steps)
        prompt, forced = tokens[:, :context], tokens[:, context : context + args.steps]
        result = run_case(model, prompt, forced, policy)
        cases.append({"text": name, "context": context, **result})
        print(
            f"{name} {context}: {len(result['true_tv'])} certificates, {time.monotonic() - started:.0f} s",
            file=sys.stderr,
        )
    result = {
        "method": __doc__.split("\n\n")[3],
        "variants": __doc__.split("\n\n")[2],
        "model": spec.name,
        "outliers": str(outliers),
        "steps": args.steps,
        "summary": summary(cases),
        "cases": [{"text": c["text"], "context": c["context"]} for c in cases],
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name, figures in result["summary"].items():
        if name not in _FACTS:
            coverage = ", ".join(f"{tau}: {value:.3f}" for tau, value in figures["coverage"].items())
            ratio = figures["ratio_to_per_token"]
            print(f"{name:14s} violations {figures['violations']}, median {figures['median']:.4f}, coverage "
                  f"({coverage}), ratio to per token median {ratio['0.5']:.2f} p90 {ratio['0.9']:.2f}")  # fmt: skip
    return 0 if all(v["violations"] == 0 for k, v in result["summary"].items() if k not in _FACTS) else 1


if __name__ == "__main__":
    sys.exit(main())
