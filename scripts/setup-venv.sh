#!/usr/bin/env bash
# Creates .venv (gitignored) with PyTorch 2.13.0: the tests run it to check that PyTorch loads
# what the crate writes, the golden scripts use it to regenerate fixtures, and the `tch`
# feature links against its libtorch; `zstandard` lets PyTorch read zstd-compressed DCP
# (`_extensions=[ZStandard()]`); `transformers` 5.24 and `huggingface_hub` 2.4 build the tiny
# Llama models the Hugging Face tests load into FSDP2 (`tests/golden/hf/load_check.py`).
# Idempotent: does nothing when all of them are there.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
if ! .venv/bin/python -c 'import sys, torch, numpy, safetensors, zstandard; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    .venv/bin/pip install --quiet --disable-pip-version-check torch==2.13.0 numpy safetensors zstandard
fi
if ! .venv/bin/python -c 'import sys, transformers, huggingface_hub; sys.exit((transformers.__version__, huggingface_hub.__version__) != ("5.24.0", "2.4.0"))' 2>/dev/null; then
    .venv/bin/pip install --quiet --disable-pip-version-check transformers==5.24.0 huggingface_hub==2.4.0
fi
.venv/bin/python -c 'import torch; print("PyTorch", torch.__version__, "in .venv")'
