"""The project's own promises: the README's commands are the ones CI and users run, the CLI explains itself."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    return re.findall(r"^    (\S.*)$", (ROOT / "README.md").read_text().split("## What exists")[0], re.M)


def test_readme_has_exactly_two_commands_and_ci_runs_the_test_one():
    commands = _readme_commands()
    assert len(commands) == 2, commands
    demo, tests = commands
    assert demo.endswith("witcert demo")
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci.splitlines()


def test_cli_help_lists_its_subcommands():
    result = subprocess.run([sys.executable, "-m", "witcert.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    from witcert.cli import build_parser

    parser = build_parser()
    subcommands = next(a for a in parser._actions if a.dest == "command").choices
    assert subcommands, "no subcommand registered"
    for name, sub in subcommands.items():
        assert name in result.stdout
        help_result = subprocess.run(
            [sys.executable, "-m", "witcert.cli", name, "--help"], capture_output=True, text=True
        )
        assert help_result.returncode == 0, (name, help_result.stderr)
        assert sub.description, f"`witcert {name} --help` has no description"


def test_the_tree_is_ruff_clean():
    # ruff is pinned in the test extra: a newer release may add rules or change the format it checks.
    for command in (["check", "."], ["format", "--check", "."]):
        result = subprocess.run([sys.executable, "-m", "ruff", *command], cwd=ROOT, capture_output=True, text=True)
        assert result.returncode == 0, f"ruff {' '.join(command)}:\n{result.stdout}{result.stderr}"


def test_no_product_module_imports_another_modules_private_names():
    import ast

    found = []
    for area in ("kernels", "integrations", "collector", "dashboards", "witcert"):
        for path in sorted((ROOT / area).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("witcert"):
                    private = [a.name for a in node.names if a.name.startswith("_") and not a.name.endswith("__")]
                    if private:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import {private}")
    assert not found, "\n".join(found)
