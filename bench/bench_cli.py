"""Start-up time of the ``witcert`` command, per command, for this tree and for an earlier commit.

Method: each command runs ``--runs`` times (default 10) as a fresh process (``python -c`` calling
``witcert.cli.main``, the console script's entry point), wall time from spawn to exit; the median is
reported. The earlier commit (``--before REF``) is extracted with ``git archive`` and laid out as the
installed package (each top-level folder under ``witcert``), first on ``PYTHONPATH``; both trees
run with the same interpreter and packages, in the same run, alternating command by command.
``query --store`` reads a chDB store made for the run (schema only); ``query --url`` asks a collector
of this tree started for the run. Results: ``bench/results/cli_startup.{json,md}``.

    python bench/bench_cli.py --before 0066ae7 [--runs 10]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
AREAS = {"kernels": "kernels", "integrations": "integrations", "collector": "collector", "dashboards": "dashboards"}


def _commands(store: str, url: str) -> dict[str, list[str]]:
    return {
        "witcert --help": ["--help"],
        "witcert --version": ["--version"],
        "witcert collector --help": ["collector", "--help"],
        "witcert query --help": ["query", "--help"],
        "witcert query coverage --store (chDB)": ["query", "coverage", "--store", store],
        "witcert query coverage --url (running collector)": ["query", "coverage", "--url", url],
        "witcert dashboards --help": ["dashboards", "--help"],
        "witcert demo --help": ["demo", "--help"],
    }


def _package_tree(ref: str, root: Path) -> Path:
    """The commit's files laid out as the installed package: root/site/witcert/{kernels,...}."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], capture_output=True, check=True).stdout
    source = root / "src"
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(source, filter="data")
    package = root / "site" / "witcert"
    package.mkdir(parents=True)
    for entry in (source / "witcert").iterdir():
        (package / entry.name).symlink_to(entry)
    for name, folder in AREAS.items():
        (package / name).symlink_to(source / folder)
    return root / "site"


def _time(arguments: list[str], pythonpath: Path | None, cwd: Path) -> tuple[float, int]:
    env = dict(os.environ, PYTHONSAFEPATH="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    program = "import sys; from witcert.cli import main; sys.exit(main(sys.argv[1:]))"
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", program, *arguments], env=env, cwd=cwd, capture_output=True)
    return time.perf_counter() - started, result.returncode


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="the earlier commit to compare with")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", type=Path, default=RESULTS / "cli_startup.json")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="witcert-bench-cli-"))
    collector = None
    try:
        before_path = _package_tree(args.before, root / "before")
        from witcert.collector.store import Store

        Store(f"chdb://{root / 'store'}").close()  # the schema, no data
        port = _free_port()
        collector = subprocess.Popen(
            [sys.executable, "-m", "witcert.cli", "collector", "--store", f"chdb://{root / 'served'}",
             "--otlp-http", f"127.0.0.1:{port}", "--no-grpc"],
            env=dict(os.environ, PYTHONSAFEPATH="1"), cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the collector did not start") from None
                time.sleep(0.2)
        commands = _commands(f"chdb://{root / 'store'}", f"http://127.0.0.1:{port}")
        rows = []
        for name, arguments in commands.items():
            samples: dict[str, list[float]] = {"before": [], "after": []}
            codes = set()
            for _ in range(args.runs):
                for label, path in (("before", before_path), ("after", None)):
                    seconds, code = _time(arguments, path, root)
                    samples[label].append(seconds)
                    codes.add((label, code))
            rows.append(
                {
                    "command": name,
                    "before_median_s": statistics.median(samples["before"]),
                    "after_median_s": statistics.median(samples["after"]),
                    "before_s": samples["before"],
                    "after_s": samples["after"],
                    "exit_codes": sorted(codes),
                }
            )
            print(f"{name:55s} {rows[-1]['before_median_s']:6.2f} s -> {rows[-1]['after_median_s']:6.2f} s", flush=True)
    finally:
        if collector is not None:
            collector.terminate()
            collector.wait(30)
        shutil.rmtree(root, ignore_errors=True)

    after_ref = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    document = {
        "method": __doc__,
        "before": args.before,
        "after": after_ref.stdout.strip() + " (working tree)",
        "runs": args.runs,
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "cpus": os.cpu_count()},
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    lines = [
        f"# `witcert` start-up time: {args.before} (before) and {document['after']} (after)",
        "",
        f"Median of {args.runs} runs per command, wall time of a fresh process; {document['machine']['platform']}, "
        f"{document['machine']['cpus']} CPUs (shared). Command: `python bench/bench_cli.py --before {args.before}`.",
        "",
        "| command | before (s) | after (s) |",
        "|---|---|---|",
        *(f"| `{r['command']}` | {r['before_median_s']:.2f} | {r['after_median_s']:.2f} |" for r in rows),
        "",
    ]
    args.out.with_suffix(".md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
