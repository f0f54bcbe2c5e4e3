"""The one ``witcert`` command. Each area contributes its subcommands through a ``register`` function.

Only the module of the command being run is imported: ``witcert --help`` and ``--version`` import
none, ``witcert query`` only the collector's command module (torch, Triton and transformers load only
for the commands that compute). A missing optional dependency of one area never breaks another's
commands. Errors a user can fix end in one line naming what was wrong, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Iterable, Sequence

from witcert import __version__
from witcert.errors import one_line

# command -> (module that registers it, one-line summary for ``witcert --help``). Each module defines
# ``register(subparsers) -> None`` adding its command(s) with their own arguments and help.
COMMANDS: dict[str, tuple[str, str]] = {
    "selftest": ("witcert.kernels.cli", "check the reference and the kernels on this machine"),
    "collector": ("witcert.collector.cli", "receive OTLP and store it in ClickHouse or chDB"),
    "query": ("witcert.collector.cli", "read coverage, heat maps, worst heads, samples from the store"),
    "schema": ("witcert.collector.cli", "print the storage DDL (single node or cluster)"),
    "dead-letter": ("witcert.collector.cli", "list, show, replay or drop spooled requests the store refused"),
    "dashboards": ("witcert.dashboards.cli", "Grafana dashboards and alerts: export, push, or serve the page"),
    "report": ("witcert.dashboards.cli", "write the dashboard's panels for a range as one self-contained HTML file"),
    "calibrate": ("witcert.integrations.calibrate", "choose the exact RoPE pairs per (layer, KV head) from a model"),
    "demo": ("witcert.demo", "the whole path in one command (generation -> OTLP -> chDB -> summary, dashboard)"),
    "sglang-config": ("witcert.integrations.sglang.cli", "validate the WITCERT_* settings of an SGLang launch"),
}


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The parser with the given commands fully registered (all of them when ``None``); the others are
    listed by name and summary only, so building it imports just the modules of ``commands``."""
    parser = argparse.ArgumentParser(
        prog="witcert",
        description=(
            "Certified int8 KV-cache quantization: every decode step returns a sound bound on how far "
            "quantization moved the attention, and the telemetry stores it in ClickHouse."
        ),
    )
    parser.add_argument("--version", action="version", version=f"witcert {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = set(COMMANDS) if commands is None else set(commands) & set(COMMANDS)
    modules = list(dict.fromkeys(COMMANDS[name][0] for name in COMMANDS if name in wanted))
    for module in modules:
        importlib.import_module(module).register(subparsers)
    for name, (_, summary) in COMMANDS.items():
        if name not in subparsers.choices:
            subparsers.add_parser(name, help=summary, add_help=False)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The command named on the line: the first word that is not an option."""
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command(argv)
    parser = build_parser([command] if command else [])
    args, unknown = parser.parse_known_args(argv)
    subparsers = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    if unknown:
        # The command's own usage, not the top-level one: `witcert demo --bogus` shows the demo's options.
        (subparsers.choices.get(args.command) or parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    # clickhouse-connect logs a refused connection itself; with no handler configured, Python's last-resort
    # handler would print it beside our one-line message. Commands that configure logging still get it.
    logging.getLogger("clickhouse_connect").addHandler(logging.NullHandler())
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (OSError, ValueError, RuntimeError) as error:
        print(f"witcert {args.command}: {one_line(error)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
