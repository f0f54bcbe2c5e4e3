"""``witcert sglang-config``: validate the ``WITCERT_*`` environment and show the KV capacity witcert buys.

Runs without SGLang installed, so an operator can check a launch environment before starting a server.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from witcert.integrations.sglang.capacity import cell_size_bytes, fp16_cell_size_bytes
from witcert.integrations.sglang.config import ENV_PREFIX, ConfigError, WitcertSGLangSettings, load_settings

LAUNCH_FLAGS = (
    "--attention-backend witcert --kv-cache-dtype auto "
    "--cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sglang-config",
        help="validate the WITCERT_* settings of an SGLang launch and show the KV capacity gained",
        description=(
            "Reads the WITCERT_* environment variables exactly as the SGLang plugin will, prints every setting "
            "in force (and whether it came from the environment), and, given a Hugging Face config.json, the KV "
            "bytes per token with and without witcert on one tensor-parallel rank. Exits 2 on an invalid or "
            "unknown WITCERT_* variable. See docs/SGLANG.md."
        ),
    )
    parser.add_argument(
        "--model-config", type=Path, help="a model's config.json, or the directory holding it (no weights needed)"
    )
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size of the launch (default 1)")
    parser.set_defaults(handler=_sglang_config)


def _kv_geometry(config_path: Path, tp_size: int) -> tuple[int, int, int]:
    """(layers, KV heads on one rank, head dim) from a Hugging Face config, as SGLang derives them."""
    path = config_path / "config.json" if config_path.is_dir() else config_path
    config = json.loads(path.read_text())
    config = config.get("text_config", config)
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    # SGLang replicates KV heads when there are fewer than ranks.
    return config["num_hidden_layers"], max(1, kv_heads // tp_size), head_dim


def _sglang_config(args: argparse.Namespace) -> int:
    console = Console()
    try:
        settings = load_settings()
    except ConfigError as error:
        print(f"witcert sglang-config: {error}", file=sys.stderr)
        return 2
    if args.tp_size < 1:
        print("witcert sglang-config: --tp-size must be at least 1", file=sys.stderr)
        return 2

    table = Table(title="witcert settings for SGLang")
    for column in ("variable", "value", "from", "meaning"):
        table.add_column(column)
    for name, field in WitcertSGLangSettings.model_fields.items():
        variable = ENV_PREFIX + name.upper()
        value = getattr(settings, name)
        source = "environment" if variable in os.environ else "default"
        shown = "unset" if value is None else str(getattr(value, "value", value))
        table.add_row(variable, shown, source, field.description or "")
    console.print(table)

    if args.model_config is not None:
        try:
            layers, kv_heads, head_dim = _kv_geometry(args.model_config, args.tp_size)
            ours = cell_size_bytes(
                num_layers=layers,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                group_size=settings.group_size,
                outlier_pairs=settings.policy().exact_pairs(),
            )
        except (OSError, KeyError, ValueError) as error:
            print(
                f"witcert sglang-config: cannot read the KV geometry of {args.model_config}: {error}", file=sys.stderr
            )
            return 2
        fp16 = fp16_cell_size_bytes(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim)
        console.print(
            f"KV bytes per token on one rank ({layers} layers, {kv_heads} KV heads, head dim {head_dim}): "
            f"fp16 {fp16}, witcert {ours}: {fp16 / ours:.3f}x the tokens in the same memory"
        )
    console.print(f"launch flags: {LAUNCH_FLAGS}")
    return 0
