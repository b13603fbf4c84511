#!/usr/bin/env bash
# Runs the end-to-end example (examples/train_resume.rs) with its resume check: a small
# transformer LM trains on 4 thread ranks, saves a sharded checkpoint, resumes on 2 ranks with
# another wrapping, and the example exits non-zero unless every resumed loss equals the
# uninterrupted run's (relative tolerance 1e-4).
#
#   scripts/run-example.sh                 # the default flow on thread ranks
#   scripts/run-example.sh --steps 40 --save-at 25   # extra arguments go to the example
#
# Built with the `test` profile (opt-level 1): scripts/test-tch.sh has already compiled
# torch-sys's C++ for that profile, so this reuses it instead of compiling it again for
# `dev` or `release`. Environment as in scripts/test-tch.sh (libtorch from .venv).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup-venv.sh
venv="$(pwd)/.venv"
export PATH="$venv/bin:$PATH"
export VIRTUAL_ENV="$venv"
export LIBTORCH_USE_PYTORCH=1
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"

cargo run --profile test --features tch --example train_resume -- "$@"
