#!/usr/bin/env bash
# Creates the two venvs that regenerate the Megatron-Core golden fixtures
# (`tests/golden/megatron/gen.py`, issue 43). Neither the tests nor CI need them.
#
#   MC19_VENV (default /work/mcore19-venv): Python 3.12 (pyenv), torch 2.13.0, megatron-core
#     0.19.2, megatron-bridge 0.6.2 (--no-deps: only its checkpoint-layout code is used), numpy,
#     psutil, packaging, safetensors. torch comes from PyPI: its Linux wheel is the CUDA build
#     (527 MB wheel, ~4 GB installed with its nvidia-* / cuda-* dependencies); PyTorch's CPU wheel
#     index is not reachable from here. It runs on the CPU (gloo) all the same.
#   MC16_VENV (default /work/mcore16-venv): Python 3.11, megatron-core 0.16.1 on top of the
#     project's `.venv` (torch 2.13.0, numpy, safetensors), seen through a `.pth` file like
#     scripts/setup-deepspeed-venv.sh does, so only megatron-core and psutil are added.
#
#   scripts/setup-venv.sh                 # first, the project's .venv (Python 3.11)
#   scripts/setup-megatron-venv.sh        # then these two
#   /work/mcore19-venv/bin/python tests/golden/megatron/gen.py
#
# Environment: MAIN_VENV (default <repo>/.venv), MC19_VENV, MC16_VENV, PYTHON312 (default
# ~/.pyenv/versions/3.12.1/bin/python, else `pyenv which python3.12`, else python3.12),
# PYTHON311 (default python3.11).
# Idempotent: each venv is left alone when its pinned versions already import.
set -euo pipefail
cd "$(dirname "$0")/.."
main_venv=${MAIN_VENV:-$PWD/.venv}
mc19=${MC19_VENV:-/work/mcore19-venv}
mc16=${MC16_VENV:-/work/mcore16-venv}
py312=${PYTHON312:-}
if [ -z "$py312" ]; then
    if [ -x "$HOME/.pyenv/versions/3.12.1/bin/python" ]; then
        py312=$HOME/.pyenv/versions/3.12.1/bin/python
    elif command -v pyenv >/dev/null && pyenv which python3.12 >/dev/null 2>&1; then
        py312=$(pyenv which python3.12)
    else
        py312=python3.12
    fi
fi
py311=${PYTHON311:-python3.11}
pip_quiet=(--quiet --disable-pip-version-check)

# --- megatron-core 0.19.2, Python 3.12 ---------------------------------------------------------
check19='import sys, torch, megatron.core as m, numpy, psutil, safetensors
sys.exit(torch.__version__.split("+")[0] != "2.13.0" or m.__version__ != "0.19.2")'
if [ ! -x "$mc19/bin/python" ]; then
    "$py312" -m venv "$mc19"
fi
if ! "$mc19/bin/python" -c "$check19" 2>/dev/null; then
    "$mc19/bin/pip" install "${pip_quiet[@]}" torch==2.13.0 numpy==2.4.6 packaging==26.4 \
        psutil==7.2.2 safetensors==0.8.0 pyyaml==6.0.4 megatron-core==0.19.2
fi
"$mc19/bin/python" -c "$check19"
# megatron-bridge: installed without its dependencies (transformers, nvidia-resiliency-ext,
# flashinfer, wandb, ...), so `megatron.bridge` does not import; it is there as the reference
# source for the Bridge layout, which gen.py writes itself (see gen.py and FORMAT.md).
if ! "$mc19/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(m.version("megatron-bridge") != "0.6.2")' 2>/dev/null; then
    "$mc19/bin/pip" install "${pip_quiet[@]}" --no-deps megatron-bridge==0.6.2
fi

# --- megatron-core 0.16.1, Python 3.11, on top of the project's .venv ---------------------------
main_site=$(cd "$main_venv" && echo "$PWD"/lib/python3.11/site-packages)
if [ ! -d "$main_site" ]; then
    echo "no $main_site: run scripts/setup-venv.sh first (with Python 3.11)" >&2
    exit 1
fi
if [ ! -x "$mc16/bin/python" ]; then
    "$py311" -m venv "$mc16"
fi
echo "$main_site" > "$mc16/lib/python3.11/site-packages/main-venv.pth"
check16='import sys, torch, megatron.core as m, numpy, psutil, safetensors
sys.exit(torch.__version__.split("+")[0] != "2.13.0" or m.__version__ != "0.16.1")'
if ! "$mc16/bin/python" -c "$check16" 2>/dev/null; then
    # torch, numpy and packaging are already satisfied through main-venv.pth.
    "$mc16/bin/pip" install "${pip_quiet[@]}" psutil==7.2.2 megatron-core==0.16.1
fi
"$mc16/bin/python" -c "$check16"

for v in "$mc19" "$mc16"; do
    "$v/bin/python" -c 'import sys, torch, megatron.core as m; print("python", sys.version.split()[0], "torch", torch.__version__, "megatron-core", m.__version__, "in", sys.prefix)'
done
