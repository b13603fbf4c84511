#!/usr/bin/env bash
# Builds, lints and tests the `tch` feature against the libtorch of PyTorch 2.13 in .venv.
#
#   scripts/test-tch.sh               # clippy --features tch, then cargo test --features tch
#   scripts/test-tch.sh --test tch_backend   # extra arguments go to `cargo test`
#
# torch-sys finds libtorch through the venv's python (LIBTORCH_USE_PYTORCH=1; it runs `python3`,
# or `python` when VIRTUAL_ENV is set, so .venv/bin goes first on PATH). build.rs then bakes
# an rpath to torch/lib into the test binaries, so no LD_LIBRARY_PATH is needed. The first build
# compiles torch-sys's C++ (several minutes per profile on 2 cores); CARGO_BUILD_JOBS defaults
# to 2 here.
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/tch-env.sh

cargo clippy --all-targets --features tch -- -D warnings
cargo test --features tch "$@"
