#!/usr/bin/env bash
# Builds, lints and tests the `mpi` feature (MpiProcessGroup over Open MPI).
#
#   scripts/test-mpi.sh                 # install Open MPI if missing, clippy, multi-process tests
#   scripts/test-mpi.sh collectives     # extra arguments filter the cases of tests/mpi.rs
#                                       # and fsdp-ckpt/tests/cli_mpi.rs
#
# Needs Debian's libopenmpi-dev and openmpi-bin (MPI headers, libmpi, mpirun) and libclang-dev
# (bindgen in mpi-sys); they are installed with apt-get when missing (root, non-interactive).
# tests/mpi.rs launches itself under `mpirun --allow-run-as-root --oversubscribe -np N` for
# N = 2, 3, 4 and fails (never skips) when mpirun is missing. CARGO_BUILD_JOBS defaults to 2.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
for pkg in libopenmpi-dev openmpi-bin libclang-dev; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$pkg")
    fi
done
if [ "${#missing[@]}" -gt 0 ]; then
    echo "installing ${missing[*]}"
    sudo_=()
    if [ "$(id -u)" -ne 0 ]; then sudo_=(sudo); fi
    export DEBIAN_FRONTEND=noninteractive
    "${sudo_[@]}" apt-get update -qq
    "${sudo_[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"

cargo clippy --all-targets --features mpi -- -D warnings
cargo clippy -p fsdp-ckpt --all-targets --features mpi -- -D warnings
# The backend's unit tests (descriptors, round plans), then the multi-process tests.
cargo test --features mpi --lib collectives::mpi::
cargo test --features mpi --test mpi -- "$@"
# fsdp-ckpt as an MPI job (reshard, consolidate) against the single-process output.
cargo test -p fsdp-ckpt --features mpi --test cli_mpi -- "$@"
