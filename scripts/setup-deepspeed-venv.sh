#!/usr/bin/env bash
# Creates a separate venv with DeepSpeed 0.19.8 (CPU only, no prebuilt ops) for regenerating the
# DeepSpeed golden fixtures (`tests/golden/deepspeed/gen.py`). Neither the tests nor CI need it.
#
# DeepSpeed is kept OUT of the project's `.venv` (installing it there could change torch); the
# new venv sees `.venv`'s packages through a `.pth` file, so it runs the very same torch
# 2.13.0 and only adds DeepSpeed and its small pure-Python dependencies on top.
#
#   scripts/setup-venv.sh                 # first, the project's .venv
#   scripts/setup-deepspeed-venv.sh       # then this one
#   $DS_VENV/bin/python tests/golden/deepspeed/gen.py
#
# Environment: MAIN_VENV (default: <repo>/.venv), DS_VENV (default: /work/ds-venv),
# DS_TARBALL (optional: a local deepspeed-0.19.8 sdist to install from instead of PyPI).
# Idempotent: does nothing when DeepSpeed 0.19.8 already imports with torch 2.13.0.
set -euo pipefail
cd "$(dirname "$0")/.."
main_venv=${MAIN_VENV:-$PWD/.venv}
ds_venv=${DS_VENV:-/work/ds-venv}
python=${PYTHON:-python3.11}
main_site=$(cd "$main_venv" && echo "$PWD"/lib/python3.11/site-packages)
if [ ! -d "$main_site" ]; then
    echo "no $main_site: run scripts/setup-venv.sh first (with Python 3.11)" >&2
    exit 1
fi
if [ ! -x "$ds_venv/bin/python" ]; then
    "$python" -m venv "$ds_venv"
fi
echo "$main_site" > "$ds_venv/lib/python3.11/site-packages/main-venv.pth"
check='import sys, torch, deepspeed; sys.exit(torch.__version__.split("+")[0] != "2.13.0" or deepspeed.__version__ != "0.19.8")'
if ! DS_ACCELERATOR=cpu "$ds_venv/bin/python" -c "$check" 2>/dev/null; then
    spec=deepspeed==0.19.8
    if [ -n "${DS_TARBALL:-}" ]; then spec=$DS_TARBALL; fi
    # torch is already satisfied through main-venv.pth, so pip adds only DeepSpeed's small
    # dependencies (hjson, msgpack, ninja, psutil, py-cpuinfo, einops, nvidia-ml-py, ...).
    DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "$ds_venv/bin/pip" install --quiet --disable-pip-version-check "$spec"
fi
DS_ACCELERATOR=cpu "$ds_venv/bin/python" -c "$check"
DS_ACCELERATOR=cpu "$ds_venv/bin/python" -c 'import torch, deepspeed; print("torch", torch.__version__, "deepspeed", deepspeed.__version__, "in '"$ds_venv"'")'
