# Sourced (not run) by the scripts that build the `tch` feature: PyTorch 2.13 in .venv, and
# torch-sys pointed at its libtorch (LIBTORCH_USE_PYTORCH=1: it runs `python` from VIRTUAL_ENV,
# so .venv/bin goes first on PATH). CARGO_BUILD_JOBS defaults to 2. Run from the repository root.
scripts/setup-venv.sh
venv="$(pwd)/.venv"
export PATH="$venv/bin:$PATH"
export VIRTUAL_ENV="$venv"
export LIBTORCH_USE_PYTORCH=1
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
