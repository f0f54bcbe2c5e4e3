"""``witcert calibrate``: choose each (layer, KV head)'s exact RoPE pairs from a model's own activations.

The model reads calibration text once (exact attention, transformers' SDPA); a capturing attention function
keeps every layer's post-RoPE keys and values and the queries at a few positions of the second half of each
text. For every (layer, KV head), ``witcert.kernels.outliers.choose_pairs`` then picks the ``m`` pairs whose
exclusion most lowers that head's mean certificate over those queries. The result is an ``OutlierFile``
(JSON, versioned, naming the model, its shape and the text) that ``KVPool``, ``WitcertCache``
(``CachePolicy.outlier_file``) and the SGLang plugin (``WITCERT_OUTLIER_FILE``) load.

Only K is calibrated: the certificate bounds the attention's TV, which depends on K's error alone (V's error
moves the output, not the attention). ``value_error`` measures what exact channels would buy V on the same
text, for the record (``docs/QUALITY.md``).
"""

from __future__ import annotations

import argparse
import hashlib
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from witcert.integrations.models import SMOLLM2, model_names
from witcert.integrations.transformers_cache import layer_windows
from witcert.kernels import reference
from witcert.kernels.outliers import (
    CalibrationSegment,
    OutlierFile,
    choose_pairs,
    lowest_frequency_pairs,
    pairs_score,
)

CAPTURE_NAME = "witcert-capture"
DEFAULT_GROUP_SIZE = 32


def default_texts() -> list[Path]:
    """Text nobody here wrote, present on any Debian system with Python: a licence and a standard-library module.

    (The quality table evaluates on other texts: ``bench/quality_table.py``.)
    """
    return [Path("/usr/share/common-licenses/Apache-2.0"), Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"]


@dataclass
class Activations:
    """One text's activations at every layer: keys and values ``[L, N, H_kv, D]``, queries ``[L, Q, H_q, D]``, and
    each layer's softmax scale (``1 / sqrt(head_dim)``, or the model's own, as Gemma's ``query_pre_attn_scalar``)."""

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    positions: torch.Tensor  # [Q]
    sm_scales: list[float]


def capture(model, input_ids: torch.Tensor, positions: torch.Tensor) -> Activations:
    """Run ``model`` over ``input_ids`` ``[1, N]`` and keep its post-RoPE K, V and the queries at ``positions``."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError("calibration reads one sequence at a time: input_ids must be [1, N]")
    num_layers = model.config.num_hidden_layers
    keys: list[torch.Tensor | None] = [None] * num_layers
    values: list[torch.Tensor | None] = [None] * num_layers
    queries: list[torch.Tensor | None] = [None] * num_layers
    sm_scales: list[float] = [float("nan")] * num_layers  # every layer's is set with its keys

    def capturing(module, query, key, value, attention_mask, **kwargs):
        layer = module.layer_idx
        sm_scales[layer] = kwargs.get("scaling") or query.shape[-1] ** -0.5
        keys[layer] = key[0].transpose(0, 1).float().cpu()  # [N, H_kv, D]
        values[layer] = value[0].transpose(0, 1).float().cpu()
        queries[layer] = query[0, :, positions.to(query.device), :].transpose(0, 1).float().cpu()  # [Q, H_q, D]
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(CAPTURE_NAME, capturing)
    AttentionMaskInterface.register(CAPTURE_NAME, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE_NAME)
    try:
        with torch.no_grad():
            model(input_ids=input_ids.to(model.device), use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    if any(k is None for k in keys):
        raise RuntimeError("the model did not run every layer's attention through the capturing function")
    return Activations(torch.stack(keys), torch.stack(values), torch.stack(queries), positions.cpu(), sm_scales)


def layer_segments(
    keys: torch.Tensor, queries: torch.Tensor, positions: torch.Tensor, window: int | None
) -> list[CalibrationSegment]:
    """One (layer, KV head)'s view of a text: the whole text, or on a sliding-window layer one segment per query
    holding the keys its window shows (the query's own token and the ``window - 1`` before it)."""
    if window is None:
        return [CalibrationSegment(keys=keys, queries=queries, positions=positions)]
    segments = []
    for i, position in enumerate(positions.tolist()):
        first = max(0, position - window + 1)
        segments.append(
            CalibrationSegment(
                keys=keys[first : position + 1], queries=queries[i : i + 1], positions=torch.tensor([position - first])
            )
        )
    return segments


def query_positions(num_tokens: int, count: int) -> torch.Tensor:
    """``count`` positions spread evenly over the second half of a text (long contexts, like decode's)."""
    first = num_tokens // 2
    count = max(1, min(count, num_tokens - first))
    return torch.linspace(first, num_tokens - 1, count).round().to(torch.int64).unique()


def value_error(values: torch.Tensor, channels: torch.Tensor | None, group_size: int) -> float:
    """Relative RMS error of V rounded to nearest (the pool's default) with ``channels`` ``[H_kv, 2m]`` exact."""
    num_tokens, kv_heads, _ = values.shape
    quantized = reference.quantize(
        values,
        seed=0,
        layer=0,
        slots=torch.arange(num_tokens),
        kind="v",
        group_size=group_size,
        outlier_channels=channels,
        dither=False,
    )
    error = quantized.dequantize() - values
    return float(error.square().mean().sqrt() / values.square().mean().sqrt())


@dataclass
class CalibrationResult:
    outliers: OutlierFile
    order: torch.Tensor  # [L, H_kv, m]: the pairs in the order chosen; the first k are the choice for m = k
    lowest_frequency_score: list[list[float]]  # [L][H_kv]: mean certificate with the lowest-frequency pairs
    calibrated_score: list[list[float]]  # [L][H_kv]: with the chosen pairs
    value_error: dict[str, float]


def calibrate(
    model,
    texts: list[tuple[str, torch.Tensor]],
    m: int,
    *,
    model_name: str,
    queries_per_text: int = 32,
    group_size: int = DEFAULT_GROUP_SIZE,
    delta_req: float = reference.DEFAULT_DELTA_REQ,
    horizon: int = reference.DEFAULT_HORIZON,
    progress=None,
) -> CalibrationResult:
    """Choose ``m`` pairs per (layer, KV head) over ``texts`` (``(description, input_ids [1, N])``)."""
    config = model.config.get_text_config(decoder=True)
    num_layers, num_q_heads = config.num_hidden_layers, config.num_attention_heads
    kv_heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_q_heads
    if head_dim % group_size:
        raise ValueError(f"group_size {group_size} must divide head_dim {head_dim}")
    if not 0 <= m <= head_dim // 2:
        raise ValueError(f"{m} pairs asked for: a head of dim {head_dim} has {head_dim // 2} RoPE pairs")
    group = num_q_heads // kv_heads
    windows = layer_windows(config)
    delta = reference.delta_step(num_layers, num_q_heads, delta_req=delta_req, horizon=horizon)
    captured = [capture(model, ids, query_positions(ids.shape[1], queries_per_text)) for _, ids in texts]

    lowest = lowest_frequency_pairs(head_dim, m)
    pairs = torch.empty(num_layers, kv_heads, m, dtype=torch.int64)
    chosen_score = [[0.0] * kv_heads for _ in range(num_layers)]
    lowest_score = [[0.0] * kv_heads for _ in range(num_layers)]
    for layer in range(num_layers):
        for head in range(kv_heads):
            heads = slice(head * group, (head + 1) * group)
            segments = []
            for a in captured:
                keys, queries = a.keys[layer, :, head], a.queries[layer][:, heads]
                segments += layer_segments(keys, queries, a.positions, windows[layer])
            options = dict(group_size=group_size, sm_scale=captured[0].sm_scales[layer], delta=delta)
            chosen, trace = choose_pairs(segments, m, **options)
            pairs[layer, head] = torch.tensor(chosen)
            chosen_score[layer][head] = trace[-1] if trace else float("nan")
            if m:
                lowest_score[layer][head] = pairs_score(segments, lowest, **options)
            if progress is not None:
                progress(layer * kv_heads + head + 1, num_layers * kv_heads)

    outliers = OutlierFile(
        model=model_name,
        num_layers=num_layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        pairs=pairs,
        calibration={
            "texts": [
                {
                    "source": description,
                    "tokens": int(ids.shape[1]),
                    "sha256": hashlib.sha256(ids.numpy().tobytes()).hexdigest(),
                }
                for description, ids in texts
            ],
            "queries_per_text": queries_per_text,
            "group_size": group_size,
            "delta_req": delta_req,
            "horizon": horizon,
            "objective": "mean certificate, capped at 1, of each KV head's query heads (greedy, one pair at a time)",
            "mean_certificate": chosen_score,
            "mean_certificate_lowest_frequency": lowest_score if m else None,
        },
    )
    v_all = torch.cat([a.values.transpose(0, 1) for a in captured]).transpose(0, 1)  # [L, N, H_kv, D]
    value_errors = {
        "none": sum(value_error(v_all[layer], None, group_size) for layer in range(num_layers)) / num_layers,
        "k_pairs": sum(value_error(v_all[layer], outliers.channels()[layer], group_size) for layer in range(num_layers))
        / num_layers,
    }
    return CalibrationResult(outliers, pairs, lowest_score, chosen_score, value_errors)


def tokenize_texts(tokenizer, paths: list[Path], tokens: int) -> list[tuple[str, torch.Tensor]]:
    """Each file's first ``tokens`` tokens (whole file if shorter), as ``(path, [1, N])``."""
    out = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as error:
            raise ValueError(f"cannot read calibration text {path}: {error.strerror or error}") from None
        ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :tokens]
        if ids.shape[1] < 16:
            raise ValueError(f"calibration text {path} has only {ids.shape[1]} tokens")
        out.append((str(path), ids))
    return out


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from witcert.integrations.models import ModelUnavailable, load_trained, model_spec

    console = Console(stderr=True)
    try:
        if args.pairs < 0:
            raise ValueError(f"--pairs must be 0 or more, got {args.pairs}")
        spec = model_spec(args.model)
        console.print(f"loading {spec.name} (converted once into the model cache)")
        model, tokenizer = load_trained(spec)
        texts = tokenize_texts(tokenizer, args.text or default_texts(), args.tokens)
        started = time.monotonic()
        with Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=console,
        ) as bar:  # fmt: skip
            task = bar.add_task(f"choosing {args.pairs} pairs per (layer, KV head)", total=None)
            result = calibrate(
                model,
                texts,
                args.pairs,
                model_name=spec.name,
                queries_per_text=args.queries,
                progress=lambda done, total: bar.update(task, completed=done, total=total),
            )
        path = result.outliers.save(args.out)
    except (ModelUnavailable, ValueError) as error:
        console.print(f"[red]witcert calibrate: {error}", soft_wrap=True)
        return 2
    flat_chosen = [x for row in result.calibrated_score for x in row]
    flat_lowest = [x for row in result.lowest_frequency_score for x in row]
    console.print(
        f"wrote {path} ({time.monotonic() - started:.0f} s): mean certificate over the calibration queries "
        f"{sum(flat_chosen) / len(flat_chosen):.4f} with the chosen pairs"
        + (f", {sum(flat_lowest) / len(flat_lowest):.4f} with the lowest-frequency ones" if args.pairs else "")
        + f"; V's relative error {result.value_error['none']:.4f} without exact channels, "
        f"{result.value_error['k_pairs']:.4f} with K's pairs exact"
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="choose each (layer, KV head)'s exact RoPE pairs from a model's activations; write the outlier file",
        description=(
            "Run a trained model over calibration text, choose per (layer, KV head) the RoPE pairs whose "
            "exclusion most lowers the mean certificate, and write a versioned outlier file that KVPool, the "
            "transformers cache (CachePolicy.outlier_file) and the SGLang plugin (WITCERT_OUTLIER_FILE) load."
        ),
    )
    parser.add_argument("--model", default=SMOLLM2.name, help=f"trained model: {model_names()} (default %(default)s)")
    parser.add_argument("--pairs", "-m", type=int, default=4, help="RoPE pairs per (layer, KV head) (default 4)")
    parser.add_argument(
        "--text", type=Path, action="append", help="calibration text file (repeatable; default: Apache-2.0 licence "
        "and the standard library's textwrap.py)",
    )  # fmt: skip
    parser.add_argument("--tokens", type=int, default=2048, help="tokens read from each text (default 2048)")
    parser.add_argument("--queries", type=int, default=32, help="query positions per text (default 32)")
    parser.add_argument("--out", type=Path, required=True, help="outlier file to write (JSON)")
    parser.set_defaults(handler=_run)
