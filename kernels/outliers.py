"""Outlier RoPE pairs chosen from measured activations, and the versioned file that carries the choice.

A pool may store ``m`` RoPE pairs of each (layer, KV head) exactly (THEORY.md section 1): those channels carry
no error and leave their group's amax. Which pairs pay off depends on the model: ``choose_pairs`` picks, for one
(layer, KV head), the ``m`` pairs whose exclusion most tightens the certificate of that head's query heads over
calibration queries, greedily (one pair at a time, each the best given those already chosen). Each candidate set
is scored with the scales recomputed without its channels and the queries without them (exact channels carry no
radius), by the P bound's small-radius form ``sqrt(sum_t p_t u_t^2) / 2`` (P is the family's tightest member
when radii are small, and this form is one matrix product per candidate set); the exact mean certificate of
section 3 (``mean_certificate``) is evaluated for each step's choice and recorded. ``lowest_frequency_pairs`` is
the model-blind alternative it is measured against.

``OutlierFile`` is the choice for a whole model, saved as JSON: schema version, the model's name and shape
(layers, KV heads, head dim), ``m``, the pairs ``[L][H_kv][m]`` and what they were calibrated on. ``KVPool``,
the transformers cache and the SGLang plugin load it; a file made for another shape is refused with a message
naming both shapes.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from witcert.kernels import reference

SCHEMA = "witcert.outlier-pairs"
SCHEMA_VERSION = 1


class OutlierFileError(ValueError):
    """An outlier file that cannot be used here: unreadable, another schema, or made for another model or shape."""


def lowest_frequency_pairs(head_dim: int, pairs: int) -> list[int]:
    """The ``pairs`` RoPE pairs of lowest frequency (rotate-half layout: the last ones)."""
    if not 0 <= pairs <= head_dim // 2:
        raise ValueError(f"{pairs} pairs: a head of dim {head_dim} has {head_dim // 2} RoPE pairs")
    return list(range(head_dim // 2 - pairs, head_dim // 2))


@dataclass(frozen=True)
class OutlierFile:
    """The exact RoPE pairs of every (layer, KV head) of one model."""

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    pairs: torch.Tensor  # int64 [L, H_kv, m], each row sorted
    calibration: dict[str, Any] = field(default_factory=dict)
    method: str = "calibrated"

    def __post_init__(self) -> None:
        pairs = torch.as_tensor(self.pairs, dtype=torch.int64)
        expected = (self.num_layers, self.num_kv_heads)
        if pairs.dim() != 3 or tuple(pairs.shape[:2]) != expected:
            raise OutlierFileError(f"pairs must be [L={expected[0]}, H_kv={expected[1]}, m], got {tuple(pairs.shape)}")
        if pairs.numel() and (int(pairs.min()) < 0 or int(pairs.max()) >= self.head_dim // 2):
            raise OutlierFileError(f"RoPE pair indices must lie in [0, {self.head_dim // 2})")
        if pairs.shape[-1] > 1 and bool((pairs.sort(-1).values.diff(dim=-1) == 0).any()):
            raise OutlierFileError("a (layer, KV head) names the same pair twice")
        object.__setattr__(self, "pairs", pairs.sort(-1).values.contiguous())

    @property
    def m(self) -> int:
        return self.pairs.shape[-1]

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.num_layers, self.num_kv_heads, self.head_dim)

    def channels(self) -> torch.Tensor:
        """The exact channels ``[L, H_kv, 2m]`` (pair ``i``: channels ``i`` and ``i + D/2``), what ``KVPool`` takes."""
        half = self.head_dim // 2
        return torch.cat((self.pairs, self.pairs + half), dim=-1).sort(-1).values

    def check(
        self, *, num_layers: int, num_kv_heads: int, head_dim: int, model: str | None = None, source: str = ""
    ) -> None:
        """Refuse a file made for another shape (or, given ``model``, another model), naming both."""
        where = f" ({source})" if source else ""
        if self.shape != (num_layers, num_kv_heads, head_dim):
            raise OutlierFileError(
                f"outlier file{where} is for {self.model} with {self.num_layers} layers, {self.num_kv_heads} KV heads, "
                f"head_dim {self.head_dim}; this cache has {num_layers} layers, {num_kv_heads} KV heads, "
                f"head_dim {head_dim}"
            )
        if model is not None and _model_key(model) != _model_key(self.model):
            raise OutlierFileError(f"outlier file{where} was calibrated on {self.model}, not on {model}")

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "model": self.model,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_layout": "rotate_half",
            "m": self.m,
            "method": self.method,
            "calibration": self.calibration,
            "pairs": self.pairs.tolist(),
        }

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def from_json(cls, data: Any, source: str = "") -> OutlierFile:
        where = f" {source}" if source else ""
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise OutlierFileError(f"{where.strip() or 'data'} is not a witcert outlier file (schema {SCHEMA!r})")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise OutlierFileError(
                f"outlier file{where} has schema version {version}; this witcert reads version {SCHEMA_VERSION}"
            )
        if data.get("rope_layout", "rotate_half") != "rotate_half":
            raise OutlierFileError(f"outlier file{where}: only the rotate_half RoPE layout is supported")
        try:
            result = cls(
                model=str(data["model"]),
                num_layers=int(data["num_layers"]),
                num_kv_heads=int(data["num_kv_heads"]),
                head_dim=int(data["head_dim"]),
                pairs=torch.tensor(data["pairs"], dtype=torch.int64),
                calibration=dict(data.get("calibration") or {}),
                method=str(data.get("method", "calibrated")),
            )
        except (KeyError, TypeError, ValueError) as error:
            if isinstance(error, OutlierFileError):
                raise OutlierFileError(f"outlier file{where}: {error}") from None
            raise OutlierFileError(f"outlier file{where} is malformed: {error}") from None
        if "m" in data and int(data["m"]) != result.m:
            raise OutlierFileError(f"outlier file{where} says m = {data['m']} but lists {result.m} pairs per head")
        return result

    @classmethod
    def load(cls, path: str | os.PathLike) -> OutlierFile:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except OSError as error:
            raise OutlierFileError(f"cannot read outlier file {path}: {error.strerror or error}") from None
        except ValueError as error:
            raise OutlierFileError(f"outlier file {path} is not valid JSON: {error}") from None
        return cls.from_json(data, str(path))

    @classmethod
    def lowest_frequency(cls, model: str, num_layers: int, num_kv_heads: int, head_dim: int, m: int) -> OutlierFile:
        pairs = torch.tensor(lowest_frequency_pairs(head_dim, m), dtype=torch.int64)
        return cls(
            model=model,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            pairs=pairs.expand(num_layers, num_kv_heads, m).clone(),
            method="lowest-frequency",
        )


def _model_key(name: str) -> str:
    return Path(str(name).rstrip("/")).name.lower()


def _group_scales(magnitude: torch.Tensor, keep: torch.Tensor, group_size: int) -> torch.Tensor:
    """``amax / 126.5`` per group of ``magnitude`` ``[N, D]`` over the channels ``keep`` ``[C, D]``: ``[C, N, G]``."""
    masked = magnitude[None] * keep[:, None, :].to(magnitude.dtype)
    return masked.unflatten(-1, (-1, group_size)).amax(-1) / reference.SCALE_DIVISOR


def mean_certificate(
    keys: torch.Tensor,
    queries: torch.Tensor,
    probs: torch.Tensor,
    lengths: torch.Tensor,
    keep: torch.Tensor,
    *,
    group_size: int,
    sm_scale: float,
    delta: float,
    dither_bits: int = 8,
) -> torch.Tensor:
    """The mean certificate (each capped at 1, where TV is trivially bounded) of one KV head's query heads, for
    each candidate exclusion: ``[C]``.

    ``keys`` ``[N, D]`` (the head's post-RoPE keys), ``queries`` ``[Q, G_q, D]`` (its query heads at ``Q``
    calibration positions), ``probs`` ``[Q, G_q, N]`` (their attention, zero beyond each position),
    ``lengths`` ``[Q]`` (tokens each query reads), ``keep`` ``[C, D]`` bool (the channels still quantized).
    The scales are recomputed without the excluded channels, the queries lose them (exact channels carry no
    radius), and section 3's bound family is evaluated on the softmax ``probs``: the certificate the kernel
    would report, up to the fp16 rounding of the scales and the dither's effect on the softmax.
    """
    scales = _group_scales(keys.abs(), keep, group_size)  # [C, N, G]
    masked_q = queries[None] * keep[:, None, None, :].to(queries.dtype)  # [C, Q, Gq, D]
    q_sq = masked_q.unflatten(-1, (-1, group_size)).square().sum(-1)  # [C, Q, Gq, G]
    sigma = sm_scale * torch.sqrt(torch.einsum("cqhg,cng->cqhn", q_sq, scales.square()) / 12.0)
    kappa = _bias_multipliers(keep, dither_bits, keys)
    certificates = []
    # Each query reads its own length: its radius multiplier and its end tiles (where the held token is found).
    for i, n in enumerate(lengths.tolist()):
        radius = (reference.tail_multiplier(int(n), delta) + kappa)[:, None, None] * sigma[:, i, :, :n]
        certificates.append(reference.accumulate_certificate(probs[i, :, :n].expand_as(radius), radius).certificate)
    return torch.stack(certificates, 1).clamp_max(1.0).mean(dim=(1, 2))


def _bias_multipliers(keep: torch.Tensor, dither_bits: int, like: torch.Tensor) -> torch.Tensor:
    """``kappa`` (``reference.bias_multiplier``) of each candidate ``keep`` ``[C, D]``, from its quantized channels."""
    channels = keep.sum(-1).tolist()
    return torch.tensor([reference.bias_multiplier(dither_bits, int(d)) for d in channels], dtype=like.dtype)


@dataclass(frozen=True)
class CalibrationSegment:
    """One calibration sequence as one (layer, KV head) sees it."""

    keys: torch.Tensor  # [N, D] post-RoPE keys
    queries: torch.Tensor  # [Q, G_q, D] the head's query heads at ``positions``
    positions: torch.Tensor  # [Q]: query i reads keys 0..positions[i]


def _prepare(segments: list[CalibrationSegment], sm_scale: float) -> list[tuple[torch.Tensor, ...]]:
    """Per segment, in float64: keys, queries, their exact causal attention and each query's length."""
    if not segments:
        raise ValueError("calibration needs at least one segment")
    prepared = []
    for segment in segments:
        keys = segment.keys.to(torch.float64)
        queries = segment.queries.to(torch.float64)
        positions = segment.positions.to(torch.int64)
        num_tokens = keys.shape[0]
        if bool((positions < 0).any()) or bool((positions >= num_tokens).any()):
            raise ValueError("query positions must index the keys")
        logits = sm_scale * torch.einsum("qhd,nd->qhn", queries, keys)
        visible = torch.arange(num_tokens)[None, :] <= positions[:, None]  # [Q, N]
        probs = torch.softmax(logits.masked_fill(~visible[:, None, :], -math.inf), dim=-1)
        prepared.append((keys, queries, probs, positions + 1))
    return prepared


def _score(prepared: list[tuple[torch.Tensor, ...]], keep: torch.Tensor, **options: Any) -> torch.Tensor:
    """Mean certificate over every segment's queries, per candidate ``keep`` ``[C, D]``: ``[C]``."""
    total = sum(mean_certificate(*segment, keep, **options) * segment[1].shape[0] for segment in prepared)
    return total / sum(segment[1].shape[0] for segment in prepared)


def _second_moment_score(
    prepared: list[tuple[torch.Tensor, ...]], keep: torch.Tensor, *, group_size: int, sm_scale: float, delta: float,
    dither_bits: int = 8,
) -> torch.Tensor:  # fmt: skip
    """The P bound in its small-radius form, ``sqrt(sum_t p_t u_t^2) / 2`` with ``u_t = (c + kappa) sigma_t``,
    averaged over every segment's queries, per candidate ``keep`` ``[C, D]``: ``[C]``.

    ``B = sum_t p_t g(u_t) ~ sum_t p_t u_t^2 / 2`` for small radii, and ``sum_t p_t sigma_t^2`` is linear in the
    squared scales: one product ``[Q, G_q, N] x [C, N, G]`` per candidate set instead of section 3's
    element-wise bound family over ``[C, Q, G_q, N]`` (which ``mean_certificate`` evaluates, for the record).
    """
    total, count = 0.0, 0
    for keys, queries, probs, lengths in prepared:
        scales = _group_scales(keys.abs(), keep, group_size)  # [C, N, G]
        weighted = torch.einsum("qhn,cng->cqhg", probs, scales.square())  # sum_t p_t s_g(t)^2
        masked_q = queries[None] * keep[:, None, None, :].to(queries.dtype)
        q_sq = masked_q.unflatten(-1, (-1, group_size)).square().sum(-1)  # [C, Q, Gq, G]
        tail = torch.tensor([reference.tail_multiplier(int(n), delta) for n in lengths.tolist()], dtype=keys.dtype)
        multiplier = tail[None, :] + _bias_multipliers(keep, dither_bits, keys)[:, None]  # [C, Q]
        second_moment = multiplier[:, :, None].square() * sm_scale**2 * (q_sq * weighted).sum(-1) / 12.0
        total = total + (second_moment.sqrt() / 2.0).sum(dim=(1, 2))
        count += queries.shape[0] * queries.shape[1]
    return total / count


def _pair_mask(pairs: list[int] | torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[len(pairs), D]``: row ``i`` marks the two channels of RoPE pair ``pairs[i]``."""
    pairs = torch.as_tensor(pairs, dtype=torch.int64)
    mask = torch.zeros(pairs.numel(), head_dim, dtype=torch.bool)
    rows = torch.arange(pairs.numel())
    mask[rows, pairs] = True
    mask[rows, pairs + head_dim // 2] = True
    return mask


def pairs_score(
    segments: list[CalibrationSegment], pairs: list[int], *, group_size: int, sm_scale: float, delta: float,
    dither_bits: int = 8,
) -> float:  # fmt: skip
    """The mean certificate of one (layer, KV head)'s query heads with exactly ``pairs`` exact."""
    head_dim = segments[0].keys.shape[-1]
    keep = ~_pair_mask(pairs, head_dim).any(0, keepdim=True)
    options = dict(group_size=group_size, sm_scale=sm_scale, delta=delta, dither_bits=dither_bits)
    return float(_score(_prepare(segments, sm_scale), keep, **options)[0])


def choose_pairs(
    segments: list[CalibrationSegment],
    m: int,
    *,
    group_size: int,
    sm_scale: float,
    delta: float,
    dither_bits: int = 8,
) -> tuple[list[int], list[float]]:
    """Greedy choice of ``m`` RoPE pairs for one (layer, KV head): ``(pairs in the order chosen, mean certificate
    after each)``. Greedy choices nest: the first ``k`` pairs are the choice for ``m = k``.

    Each step adds the pair whose exclusion most lowers ``_second_moment_score`` (the P bound's small-radius
    form) over all segments' queries, given the pairs already chosen; the trace is the exact mean certificate
    (``mean_certificate``) after each step. Float64 throughout.
    """
    prepared = _prepare(segments, sm_scale)
    head_dim = prepared[0][0].shape[-1]
    half = head_dim // 2
    if not 0 <= m <= half:
        raise ValueError(f"m = {m}: a head of dim {head_dim} has {half} RoPE pairs")
    options = dict(group_size=group_size, sm_scale=sm_scale, delta=delta, dither_bits=dither_bits)
    chosen: list[int] = []
    trace: list[float] = []
    keep = torch.ones(head_dim, dtype=torch.bool)
    for _ in range(m):
        left = [p for p in range(half) if p not in chosen]
        trials = keep[None] & ~_pair_mask(left, head_dim)  # [C, D]
        best = int(_second_moment_score(prepared, trials, **options).argmin())
        keep = trials[best]
        chosen.append(left[best])
        trace.append(float(_score(prepared, keep[None], **options)[0]))
    return chosen, trace
