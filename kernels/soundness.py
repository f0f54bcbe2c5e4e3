"""Monte Carlo soundness check: does the certificate bound the true TV(p, p~) as often as promised?

Each draw is one (query head, step): keys are quantized with a fresh dither seed, the query reads
them through the reference decode, and the true TV is computed from the unquantized keys in
float64. A violation is a draw whose true TV exceeds its certificate; THEORY.md allows at most a
``delta_step`` fraction, and expects none.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

import torch

from witcert.kernels import reference

KeyLaw = Literal["gaussian", "outlier_channels"]


@dataclass
class SoundnessReport:
    draws: int
    violations: int
    allowed_violations: int
    delta_step: float
    box_misses: int  # draws where some |d_t| > u_t (the event the proof conditions on failed)
    median_ratio: float  # certificate / true TV
    p90_ratio: float
    vacuous_fraction: float
    shapes: str

    def as_dict(self) -> dict:
        return asdict(self)


def binomial_upper_quantile(trials: int, p: float, tail: float = 1e-6) -> int:
    """Smallest k with P(Binomial(trials, p) > k) <= tail: the violations a correct bound may show."""
    log_q = math.log1p(-p)
    cumulative = 0.0
    for k in range(trials + 1):
        log_pmf = math.lgamma(trials + 1) - math.lgamma(k + 1) - math.lgamma(trials - k + 1)
        log_pmf += k * math.log(p) + (trials - k) * log_q
        cumulative += math.exp(log_pmf)
        if 1.0 - cumulative <= tail:
            return k
    return trials


def _keys(law: KeyLaw, tokens: int, kv_heads: int, head_dim: int, generator: torch.Generator) -> torch.Tensor:
    keys = torch.randn(tokens, kv_heads, head_dim, generator=generator, dtype=torch.float64)
    if law == "outlier_channels":
        # A few channels an order of magnitude larger than the rest, as in real post-RoPE keys.
        channels = torch.randperm(head_dim, generator=generator)[:4]
        keys[:, :, channels] *= 20.0 + 30.0 * torch.rand(4, generator=generator, dtype=torch.float64)
    return keys.to(torch.float16)


def run_soundness(
    *,
    draws: int,
    tokens: tuple[int, ...] = (256, 1024, 4096),
    kv_heads: int = 2,
    group: int = 7,
    head_dim: int = 128,
    steps_per_cache: int = 4,
    laws: tuple[KeyLaw, ...] = ("gaussian", "outlier_channels"),
    dither_bits: int = 8,
    num_layers: int = 28,
    seed: int = 0,
) -> SoundnessReport:
    """Draw ``draws`` (head, step) certificates and compare each with the true TV."""
    generator = torch.Generator().manual_seed(seed)
    q_heads = kv_heads * group
    delta = reference.delta_step(num_layers, q_heads)
    sm_scale = 1.0 / math.sqrt(head_dim)
    ratios: list[torch.Tensor] = []
    violations = box_misses = vacuous = done = cache_index = 0
    while done < draws:
        law = laws[cache_index % len(laws)]
        num_tokens = tokens[cache_index % len(tokens)]
        keys = _keys(law, num_tokens, kv_heads, head_dim, generator)
        slots = torch.randperm(4 * num_tokens, generator=generator)[:num_tokens]
        common = dict(seed=seed * 1_000_003 + cache_index, layer=cache_index % num_layers, slots=slots)
        k = reference.quantize(keys, kind="k", dither_bits=dither_bits, **common)
        v = reference.quantize(keys, kind="v", dither_bits=dither_bits, **common)
        exact_keys = keys.to(torch.float64)[:, torch.arange(q_heads) // group, :]
        for _ in range(steps_per_cache):
            # Query scale sets the attention's sharpness: from nearly uniform to a few dominant tokens.
            temperature = float(torch.empty(1).uniform_(0.5, 4.0, generator=generator))
            q = temperature * torch.randn(q_heads, head_dim, generator=generator, dtype=torch.float64)
            result = reference.decode_attention(q, k, v, sm_scale=sm_scale, delta_step=delta)
            true_logits = sm_scale * torch.einsum("hd,shd->hs", q, exact_keys)
            true_probs = torch.softmax(true_logits, dim=-1)
            kernel_logits = result.lse[:, None] + torch.log(result.probs)
            box_misses += int(((kernel_logits - true_logits).abs() > result.radius).any(-1).sum())
            tv = reference.total_variation(true_probs, result.probs)
            certificate = result.certificate
            violations += int((tv > certificate).sum())
            vacuous += int((certificate >= 1).sum())
            ratios.append(certificate / tv.clamp_min(1e-300))
            done += q_heads
        cache_index += 1
    ratio = torch.cat(ratios)
    return SoundnessReport(
        draws=done,
        violations=violations,
        allowed_violations=binomial_upper_quantile(done, delta),
        delta_step=delta,
        box_misses=box_misses,
        median_ratio=float(ratio.median()),
        p90_ratio=float(ratio.quantile(0.9)),
        vacuous_fraction=vacuous / done,
        shapes=f"D={head_dim}, S in {tokens}, {group} query heads per KV head, keys {laws}, {dither_bits}-bit dither",
    )


def random_bound_cases(count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` small cases ``(probs, radius)`` of 8 tokens for checking the bound family against the
    exact worst case: temperatures from flat to sharp, a sink token in 30%, uniform and mixed radii."""
    tokens = 8
    logits = torch.randn(count, tokens, generator=generator, dtype=torch.float64)
    logits *= torch.logspace(-1, 1.3, count, dtype=torch.float64)[torch.randperm(count, generator=generator)][:, None]
    sink = torch.rand(count, generator=generator) < 0.3
    logits[sink, 0] += 8.0  # a sink token holding most of the attention
    probs = torch.softmax(logits, -1)
    magnitude = torch.logspace(-3, 0.5, count, dtype=torch.float64)[torch.randperm(count, generator=generator)]
    radius = magnitude[:, None] * torch.rand(count, tokens, generator=generator, dtype=torch.float64)
    uniform = torch.rand(count, generator=generator) < 0.3
    radius[uniform] = magnitude[uniform, None].expand(-1, tokens)
    return probs, radius
