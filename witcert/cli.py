"""The one ``witcert`` command. Each area contributes its subcommands through a ``register`` function.

Subcommand modules are imported lazily, so ``witcert --help`` stays fast and a missing optional
dependency of one area never breaks another area's commands.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# module path -> one-line summary shown by ``witcert --help``. Each module defines
# ``register(subparsers) -> None`` that adds its subcommand(s) with their own help.
SUBCOMMAND_MODULES: dict[str, str] = {
    "witcert.kernels.cli": "selftest: check the reference and the kernels on this machine",
    "witcert.dashboards.cli": "dashboards: export Grafana provisioning files or push them to a Grafana",
    "witcert.collector.cli": "collector, query, schema, dead-letter: receive OTLP, store in ClickHouse/chDB, read it",
    "witcert.demo": "demo: the whole path in one command (generation -> OTLP -> chDB -> summary, dashboard)",
    "witcert.integrations.sglang.cli": "sglang-config: validate the WITCERT_* settings of an SGLang launch",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="witcert",
        description=(
            "Certified int8 KV-cache quantization: every decode step returns a sound bound on how far "
            "quantization moved the attention, and the telemetry stores it in ClickHouse."
        ),
    )
    from witcert import __version__

    parser.add_argument("--version", action="version", version=f"witcert {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
