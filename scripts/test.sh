#!/usr/bin/env bash
# Set up and run the whole test suite: lint, type check, then every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,worker-cpu
echo "==> ruff"
.venv/bin/ruff check operator tests e2e benchmarks
.venv/bin/ruff format --check operator tests e2e benchmarks
echo "==> mypy"
.venv/bin/mypy
echo "==> pytest"
# pytest exits 5 when it collected no test: that fails this script too.
.venv/bin/pytest -q "$@"
