#!/usr/bin/env bash
# Runs the end-to-end example's FSDP2 mode (examples/train_resume.rs --fsdp 2) and PyTorch's
# continuation of it (examples/train_resume_torch.py), on thread ranks:
#
# 1. Rust trains a small transformer LM on 4 ranks with per-parameter shards (FSDP2 all-gather
#    and reduce-scatter), saving a DCP checkpoint (model and Adam) after step K;
# 2. Rust resumes that checkpoint on 2 ranks (another fully_shard wrapping) and exits non-zero
#    unless every loss equals the uninterrupted run's (relative tolerance 1e-4);
# 3. PyTorch 2.13 (.venv) loads the same checkpoint into a real FSDP2 model at 2 ranks
#    (dcp.load + set_state_dict), trains the same steps on the same batches and exits non-zero
#    unless its losses equal the Rust run's (relative tolerance 1e-4).
#
#   scripts/run-example-fsdp2.sh                          # 60 steps, checkpoint after 30
#   scripts/run-example-fsdp2.sh --steps 40 --save-at 25  # extra arguments go to the training run
#
# Built with the `test` profile, as scripts/run-example.sh (reuses torch-sys's build).
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/tch-env.sh

cargo build --profile test --features tch --example train_resume
target="$(realpath "${CARGO_TARGET_DIR:-target}")"
exe="$target/debug/examples/train_resume"
tmp="$(mktemp -d "$target/fsdp2-example.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

"$exe" --phase train --fsdp 2 --world-size 4 --ckpt "$tmp/ckpt" --curve "$tmp/curve.json" "$@"
"$exe" --phase resume --fsdp 2 --world-size 2 --ckpt "$tmp/ckpt" --curve "$tmp/curve.json"
python examples/train_resume_torch.py "$tmp/ckpt" "$tmp/curve.json" --world-size 2
