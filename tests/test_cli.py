"""The ``witcert`` command answers at once and explains itself: light commands import no heavy library,
every bad argument gets one line saying what was wrong (no traceback, no pydantic dump, no temporary
directory left behind), an unknown option shows the command's own usage, and ``witcert report`` and
``witcert demo --no-serve`` write a report. Start-up times are measured in ``bench/bench_cli.py``.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

HEAVY = ("torch", "triton", "transformers", "chdb")


def witcert(*arguments: str, tmp_path: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    # TRITON_INTERPRET=0: a CPU decode takes the reference path, as in tests/test_demo.py.
    env = dict(os.environ, PYTHONSAFEPATH="1", TMPDIR=str(tmp_path), TRITON_INTERPRET="0")
    return subprocess.run(
        [sys.executable, "-m", "witcert.cli", *arguments],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "arguments",
    [["--help"], ["--version"], ["collector", "--help"], ["query", "--help"], ["dashboards", "--help"]],
    ids=" ".join,
)
def test_light_commands_import_no_heavy_library(arguments: list[str]):
    program = (
        "import sys\nfrom witcert.cli import main\n"
        f"try:\n    main({arguments!r})\nexcept SystemExit:\n    pass\n"
        f"print(sorted(name for name in {HEAVY!r} if name in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_top_level_help_still_lists_every_command(tmp_path: Path):
    from witcert.cli import COMMANDS

    result = witcert("--help", tmp_path=tmp_path)
    assert result.returncode == 0
    for name, (_, summary) in COMMANDS.items():
        assert name in result.stdout and summary[:30] in " ".join(result.stdout.split())


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _demo_data_dir(root: Path) -> Path:
    """A folder laid out as ``witcert demo --data-dir`` leaves it: the store is its chdb subfolder."""
    (root / "demo" / "chdb" / "metadata").mkdir(parents=True)
    return root / "demo"


def _entries(folder: Path) -> set[str]:
    # torch keeps a compile cache in the temporary directory when it is first imported: not ours.
    return {entry.name for entry in folder.iterdir() if not entry.name.startswith("torchinductor")}


BAD_ARGUMENTS = {
    "demo --data-dir not writable": (
        ["demo", "--data-dir", "/proc/witcert-demo", "--steps", "1"],
        "/proc/witcert-demo",
    ),
    "demo --listen garbage": (["demo", "--listen", "garbage", "--steps", "1"], "'garbage' is not HOST:PORT"),
    "demo --tau -1": (["demo", "--tau", "-1", "--steps", "1"], "tau: Input should be greater than 0"),
    "collector --otlp-http garbage": (["collector", "--otlp-http", "garbage"], "'garbage' is not HOST:PORT"),
    "dashboards serve --listen garbage": (["dashboards", "serve", "--listen", "garbage"], "--listen listen address"),
    "query --tau -1": (["query", "coverage", "--tau", "-1", "--store", "chdb://{tmp}/none"], "tau must be"),
    "query --store demo data dir": (["query", "coverage", "--store", "chdb://{demo}"], "use chdb://{demo}/chdb"),
    "report --store demo data dir": (
        ["report", "--store", "chdb://{demo}", "--out", "r.html"],
        "use chdb://{demo}/chdb",
    ),
    "query unreachable ClickHouse": (
        ["query", "coverage", "--store", "clickhouse://127.0.0.1:{port}/default"],
        "cannot reach ClickHouse at 127.0.0.1:{port} (Connection refused)",
    ),
    "push Grafana URL without scheme": (["dashboards", "push", "--grafana", "grafana:3000"], "write it as http://"),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_every_bad_argument_gets_one_line_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, case: str
):
    from witcert.cli import main

    arguments, message = BAD_ARGUMENTS[case]
    fill = {"tmp": tmp_path, "demo": _demo_data_dir(tmp_path), "port": _closed_port()}
    arguments = [argument.format(**fill) for argument in arguments]
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a demo would put its temporary store
    monkeypatch.chdir(tmp_path)
    before = _entries(tmp_path)
    assert main(arguments) != 0  # an exception escaping here would be a traceback for the user
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    (line,) = lines
    assert line.startswith(f"witcert {arguments[0]}"), line
    assert message.format(**fill) in line, line
    assert "pydantic" not in line
    assert _entries(tmp_path) == before  # no temporary directory or store left behind


def test_an_unknown_option_shows_the_commands_own_usage(tmp_path: Path):
    result = witcert("demo", "--bogus", tmp_path=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("usage: witcert demo")
    assert "--no-serve" in result.stderr and "unrecognized arguments: --bogus" in result.stderr


def test_demo_no_serve_writes_a_report_and_report_writes_another(tmp_path: Path):
    data = tmp_path / "data"
    demo = witcert(
        "demo", "--no-serve", "--model", "random", "--data-dir", str(data), "--steps", "4", "--prompt-tokens", "16",
        "--layers", "1", tmp_path=tmp_path,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stderr
    printed = re.search(r"report: (\S+\.html)", " ".join(demo.stdout.split()))
    assert printed, demo.stdout
    written = Path(printed.group(1))
    assert written.parent == data and written.exists()
    report = witcert("report", "--store", f"chdb://{data / 'chdb'}", "--out", "incident.html", tmp_path=tmp_path)
    assert report.returncode == 0, report.stderr
    assert report.stdout.strip() == "incident.html"
    for page in (written, tmp_path / "incident.html"):
        text = page.read_text()
        assert "window.WITCERT_REPORT" in text and not re.search(r'(src|href)="(?!data:)', text)
