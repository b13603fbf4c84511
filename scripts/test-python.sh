#!/usr/bin/env bash
# The Python package (python/): shows both ways it installs, then runs its pytest suite.
#  1. `pip install ./python` in a new virtual environment (target/py-fresh, no PyTorch): pip
#     fetches maturin and builds the package with cargo; `fsdp-ckpt` and `import fsdp_ckpt`
#     work there.
#  2. `maturin build --release` makes the wheel (reusing that build), which is installed into
#     .venv (PyTorch 2.13) from the file alone, with no Rust toolchain on PATH and no index.
#  3. pytest in .venv: every function and the executable against the fixtures, `describe` in
#     real FSDP1/FSDP2 ranks. Its summary line is the last line printed.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-venv.sh >/dev/null
root=$(pwd)
export CARGO_TARGET_DIR="$root/target/python"

echo "== pip install ./python in a new virtual environment"
rm -rf target/py-fresh
python3 -m venv target/py-fresh
target/py-fresh/bin/pip install --quiet --disable-pip-version-check ./python
(cd /tmp && "$root/target/py-fresh/bin/fsdp-ckpt" --version \
    && "$root/target/py-fresh/bin/python" -c 'import fsdp_ckpt; print("import fsdp_ckpt", fsdp_ckpt.__version__, "from", fsdp_ckpt.__file__)')

echo "== wheel, installed without a Rust toolchain"
.venv/bin/pip install --quiet --disable-pip-version-check 'maturin>=1.5,<2' 'pytest>=7'
rm -rf target/wheels
.venv/bin/maturin build --quiet --release -m python/Cargo.toml -o target/wheels
wheel=$(ls target/wheels/fsdp_ckpt-*.whl)
env -i HOME="$HOME" PATH=/usr/bin:/bin bash -c \
    "! command -v cargo >/dev/null && ! command -v rustc >/dev/null \
     && .venv/bin/pip install --quiet --disable-pip-version-check --no-index --force-reinstall '$wheel'"
echo "installed $(basename "$wheel") into .venv (no cargo or rustc on PATH, no package index)"

echo "== pytest"
cd /tmp && exec "$root/.venv/bin/python" -m pytest "$root/python/tests" -q -p no:cacheprovider "$@"
