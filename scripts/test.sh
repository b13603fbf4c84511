#!/usr/bin/env bash
# The test command: prepares what the tests need (PyTorch 2.13 in .venv, which the tests compare
# the crate's output with), then runs the whole test suite. Works on a fresh clone; extra
# arguments go to `cargo test` (e.g. `scripts/test.sh --test it checkpoint::`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-venv.sh
exec cargo test --workspace "$@"
