#!/usr/bin/env bash
# Creates .venv (gitignored) with PyTorch 2.13.0: the tests run it to check that PyTorch loads
# what the crate writes, the golden scripts use it to regenerate fixtures, and the `tch`
# feature links against its libtorch. Idempotent: does nothing when torch 2.13.0 is there.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
if ! .venv/bin/python -c 'import sys, torch, numpy, safetensors; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    .venv/bin/pip install --quiet --disable-pip-version-check torch==2.13.0 numpy safetensors
fi
.venv/bin/python -c 'import torch; print("PyTorch", torch.__version__, "in .venv")'
