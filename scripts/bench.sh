#!/usr/bin/env bash
# Reproduces every figure in BENCHMARKS.md: every benchmark (optimizer-state transforms,
# checkpoints, the side-by-side runs with PyTorch, the scale run and the Hugging Face export) in one go,
# each headed by the machine, its load average and the date, so that the
# numbers carry their conditions. Needs .venv (PyTorch 2.13) for the side-by-side run; installs
# it when missing. Extra arguments name a subset: `scripts/bench.sh checkpoint`. When `mpirun`
# exists, the side-by-side bench is built with `mpi` and adds its MPI column (the crate's ranks
# as processes) and the scale bench also times `mpirun -np 1|2|4 fsdp-ckpt`; without it that
# column says it was not built and the scale bench leaves the tool out.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-venv.sh
benches=("$@")
[ ${#benches[@]} -gt 0 ] || benches=(optim_state checkpoint side_by_side dcp state_dict scale hf_export)
conditions() {
    echo "== $1: $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB," \
        "load average $(cut -d' ' -f1-3 /proc/loadavg), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    grep -m1 'model name' /proc/cpuinfo || true
}
for b in "${benches[@]}"; do
    conditions "$b (before)"
    if [ "$b" = side_by_side ] && command -v mpirun >/dev/null; then
        cargo bench --features mpi --bench "$b"
    elif [ "$b" = scale ] && command -v mpirun >/dev/null; then
        # The tool as an MPI job at 1, 2 and 4 processes beside the single-process library calls.
        cargo build --release -p fsdp-ckpt --features mpi
        SCALE_BENCH_TOOL="$PWD/target/release/fsdp-ckpt" cargo bench --bench "$b"
    else
        cargo bench --bench "$b"
    fi
    conditions "$b (after)"
done
