#!/usr/bin/env bash
# Runs the end-to-end example (examples/train_resume.rs) with its resume check: a small
# transformer LM trains on 4 ranks, saves a sharded checkpoint, resumes on 2 ranks with another
# wrapping, and the example exits non-zero unless every resumed loss equals the uninterrupted
# run's (relative tolerance 1e-4).
#
#   scripts/run-example.sh                          # thread ranks in one process
#   scripts/run-example.sh --steps 40 --save-at 25  # extra arguments go to the example
#   scripts/run-example.sh --mpi                    # one process per rank: mpirun -np 4, then -np 2
#                                                   # (needs the `mpi` feature and Open MPI)
#
# Built with the `test` profile (opt-level 1): scripts/test-tch.sh has already compiled
# torch-sys's C++ for that profile, so this reuses it instead of compiling it again for
# `dev` or `release`. Environment as in scripts/test-tch.sh (libtorch from .venv).
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/tch-env.sh

if [ "${1:-}" != "--mpi" ]; then
    exec cargo run --profile test --features tch --example train_resume -- "$@"
fi
shift
cargo build --profile test --features tch,mpi --example train_resume
exe="$(realpath "${CARGO_TARGET_DIR:-target}")/debug/examples/train_resume"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
mpirun=(mpirun --allow-run-as-root --oversubscribe)
"${mpirun[@]}" -np 4 "$exe" --phase train --ckpt "$tmp/ckpt" --curve "$tmp/curve.json" "$@"
"${mpirun[@]}" -np 2 "$exe" --phase resume --ckpt "$tmp/ckpt" --curve "$tmp/curve.json"
