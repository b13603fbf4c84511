#!/usr/bin/env bash
# The NCCL backend on a real GPU, in two halves (README, "NCCL": what has run on a GPU).
#
#   scripts/gpu-check.sh build   # here, on CPU (and in CI): builds the kit, gpu-kit/
#   gpu-kit/run.sh               # there, on a machine with an NVIDIA GPU: runs it
#
# `build` compiles, with the `nccl` feature, tests/nccl.rs and the library's unit tests (the
# commands of CI's nccl phase, so CI rebuilds nothing), copies the two executables (named by
# cargo's JSON messages) stripped into gpu-kit/bin/ (ignored by git) with this script as
# gpu-kit/run.sh, and fails when the working tree plus the kit would not fit the 64 MiB that
# can be sent to the GPU machine.
#
# `run.sh` needs no cargo and no network. It finds libcuda (ldconfig, then the usual driver
# folders) and NCCL (libnccl.so* in the Python site-packages, e.g. the nvidia-nccl-cu13 wheel;
# then ldconfig), makes the name cudarc loads, `libnccl.so`, a symlink in a temporary folder on
# LD_LIBRARY_PATH (the wheel ships only libnccl.so.2), prints the driver, GPU and NCCL
# versions, and runs with FSDP_REQUIRE_GPU=1 (a test that would skip fails instead):
#   probe    the crate's probe, NCCL version, device and driver (tests/nccl.rs)
#   nccl     tests/nccl.rs: the conformance suite at world size 1, the device collectives
#   lib      the library's unit tests of collectives::nccl
#   timed    all_gather_device, reduce_scatter_device and broadcast_device of 1 GiB against a
#            device-to-device copy of the same bytes, results checked bit for bit
#   fsdp2    tests/it/fsdp2_comm.rs's collectives through NcclProcessGroup at world size 1,
#            compared bit for bit with ThreadGroup's
# then one summary table (step, status, time). Every step has a time limit and all together
# stay under GPU_KIT_TIME_LIMIT (170 s). Exit status 0 only when every step passed.
#
# Overrides, for scripts/test-gpu-kit.sh on a CPU machine: GPU_KIT_BIN (folder of the executables),
# GPU_KIT_LDCONFIG (command listing the loader cache; empty: none), GPU_KIT_CUDA_DIRS (folders
# searched for libcuda), GPU_KIT_PYTHON (the Python asked for its site-packages),
# GPU_KIT_SITE_DIRS (the site-packages folders, instead of asking Python), GPU_KIT_NVIDIA_SMI,
# GPU_KIT_TIME_LIMIT (seconds for everything).
set -uo pipefail

die() {
    echo "gpu-check: $*" >&2
    exit 1
}

# ---------------------------------------------------------------- build (CPU) ----------------

# The executables cargo reports for `cargo test ARGS --no-run`, as "target-name path" lines.
test_executables() {
    cargo test "$@" --no-run --message-format=json-render-diagnostics |
        python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])'
}

# Bytes of the files git would send: tracked and untracked ones that are not ignored.
tree_bytes() {
    git ls-files -z --cached --others --exclude-standard |
        while IFS= read -r -d '' f; do [ -f "$f" ] && [ ! -L "$f" ] && printf '%s\0' "$f"; done |
        du -cb --files0-from=- | tail -1 | cut -f1
}

build() {
    cd "$(dirname "${BASH_SOURCE[0]}")/.." || die "no repository"
    local kit=gpu-kit limit=$((64 * 1024 * 1024)) started=$SECONDS
    # The same commands (and environment, from .ci/run) as CI's nccl phase: nothing rebuilds.
    local lib nccl
    lib=$(test_executables --features nccl --lib | awk '$1 == "fsdp" {print $2}') || exit 1
    nccl=$(test_executables --features nccl --test nccl | awk '$1 == "nccl" {print $2}') || exit 1
    [ -x "$lib" ] || die "cargo named no unit-test executable for the library ($lib)"
    [ -x "$nccl" ] || die "cargo named no executable for tests/nccl.rs ($nccl)"
    rm -rf "$kit"
    mkdir -p "$kit/bin"
    strip --strip-debug -o "$kit/bin/lib" "$lib" || die "strip $lib"
    strip --strip-debug -o "$kit/bin/nccl" "$nccl" || die "strip $nccl"
    cp scripts/gpu-check.sh "$kit/run.sh"
    chmod +x "$kit/run.sh"
    {
        echo "commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- || echo ' (with local changes)')"
        echo "built $(date -u +%FT%TZ) by $(rustc --version)"
        echo "bin/lib  <- $lib"
        echo "bin/nccl <- $nccl"
    } >"$kit/MANIFEST"
    local kit_bytes tree total
    kit_bytes=$(du -cb "$kit" | tail -1 | cut -f1)
    tree=$(tree_bytes)
    total=$((kit_bytes + tree))
    mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
    echo "gpu-kit: $(mib "$kit_bytes") (bin/lib $(mib "$(stat -c %s "$kit/bin/lib")")," \
        "bin/nccl $(mib "$(stat -c %s "$kit/bin/nccl")")); working tree $(mib "$tree");" \
        "together $(mib "$total") of the 64 MiB the GPU machine accepts; $((SECONDS - started)) s"
    if [ "$total" -gt "$limit" ]; then
        die "working tree plus kit is $(mib "$total"), over 64 MiB: it cannot be sent"
    fi
    echo "on the GPU machine, from the repository root: gpu-kit/run.sh"
}

# ---------------------------------------------------------------- run (GPU) ------------------

rows=()
failed=0
log_dir=""
deadline=0

# run_step NAME LIMIT MIN_PASSED CMD...: runs CMD with the smaller of LIMIT and the time left,
# output shown and kept in $log_dir/NAME.log. MIN_PASSED > 0: CMD is a libtest executable that
# must report at least that many passed tests (a filter that matches nothing fails).
run_step() {
    local name=$1 limit=$2 min_passed=$3
    shift 3
    local left=$((deadline - SECONDS)) status t0 rc passed
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -le 0 ]; then
        rows+=("$name|FAIL: no time left|0.0s")
        failed=1
        return
    fi
    echo "== $name (time limit ${limit}s): $*"
    t0=$(date +%s%N)
    timeout -k 5 "$limit" "$@" 2>&1 | tee "$log_dir/$name.log"
    rc=${PIPESTATUS[0]}
    local took
    took=$(awk -v a="$t0" -v b="$(date +%s%N)" 'BEGIN {printf "%.1fs", (b - a) / 1e9}')
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        status="FAIL: timed out after ${limit}s"
    elif [ "$rc" -ne 0 ]; then
        status="FAIL: exit status $rc"
    else
        status=ok
        if [ "$min_passed" -gt 0 ]; then
            passed=$(sed -n 's/^test result: ok\. \([0-9]*\) passed.*/\1/p' "$log_dir/$name.log" |
                awk '{n += $1} END {print n + 0}')
            if [ "$passed" -lt "$min_passed" ]; then
                status="FAIL: $passed tests ran, expected $min_passed or more"
            fi
        fi
    fi
    [ "$status" = ok ] || failed=1
    rows+=("$name|$status|$took")
}

skip_step() {
    rows+=("$1|FAIL: not run ($2)|-")
    failed=1
}

# The command listing the loader cache (ldconfig is often in /sbin, off a user's PATH).
ldconfig_command() {
    if [ -n "${GPU_KIT_LDCONFIG+set}" ]; then
        echo "$GPU_KIT_LDCONFIG"
    elif command -v ldconfig >/dev/null; then
        echo "ldconfig -p"
    elif [ -x /sbin/ldconfig ]; then
        echo "/sbin/ldconfig -p"
    fi
}

# The first libcuda.so.1 (or libcuda.so) the loader cache lists, else one in the driver folders;
# a folder found that way goes onto LD_LIBRARY_PATH. CUDA's link-time stubs never count.
find_libcuda() {
    local ldconfig path=""
    ldconfig=$(ldconfig_command)
    if [ -n "$ldconfig" ]; then
        path=$($ldconfig 2>/dev/null | awk '$1 ~ /^libcuda\.so(\.1)?$/ && $NF !~ /\/stubs\// {print $NF; exit}')
    fi
    if [ -n "$path" ]; then
        echo "libcuda: $path (loader cache)"
        return 0
    fi
    local dirs=${GPU_KIT_CUDA_DIRS-/usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/wsl/lib /usr/local/cuda*/lib64 /usr/local/cuda*/compat}
    local d f
    for d in $dirs; do
        for f in "$d/libcuda.so.1" "$d/libcuda.so"; do
            if [ -e "$f" ] && [[ "$f" != */stubs/* ]]; then
                export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
                echo "libcuda: $f (added $d to LD_LIBRARY_PATH)"
                return 0
            fi
        done
    done
    echo "libcuda: not found (loader cache: ${ldconfig:-none}; folders: $dirs)"
    return 1
}

# The site-packages folders to search for NCCL: Python's own, then the usual system ones.
site_dirs() {
    if [ -n "${GPU_KIT_SITE_DIRS+set}" ]; then
        tr ' ' '\n' <<<"$GPU_KIT_SITE_DIRS"
        return
    fi
    local py=${GPU_KIT_PYTHON:-python3}
    "$py" -c 'import site, sys
print("\n".join(site.getsitepackages() + [site.getusersitepackages()] + sys.path))' 2>/dev/null
    ls -d ${VIRTUAL_ENV:+"$VIRTUAL_ENV"/lib/python3*/site-packages} \
        /usr/local/lib/python3*/*-packages /usr/lib/python3*/*-packages \
        /opt/conda/lib/python3*/site-packages "$HOME"/.local/lib/python3*/site-packages 2>/dev/null
}

# libnccl.so* from site-packages (nvidia/**/lib, torch/lib), else from the loader cache, linked
# as `libnccl.so` (the name cudarc 0.19 tries first) in a temporary folder put first on
# LD_LIBRARY_PATH.
find_nccl() {
    local d f=""
    while IFS= read -r d; do
        [ -n "$d" ] && [ -d "$d" ] || continue
        f=$(find "$d/nvidia" "$d/torch/lib" -maxdepth 3 -name 'libnccl.so*' 2>/dev/null | sort | head -1)
        [ -n "$f" ] && break
    done < <(site_dirs)
    local ldconfig
    ldconfig=$(ldconfig_command)
    if [ -z "$f" ] && [ -n "$ldconfig" ]; then
        f=$($ldconfig 2>/dev/null | awk '$1 ~ /^libnccl\.so/ {print $NF; exit}')
    fi
    if [ -z "$f" ] || [ ! -f "$f" ]; then
        echo "libnccl: not found (no libnccl.so* under nvidia/ or torch/lib in: $(site_dirs | sed '/^$/d' | sort -u | tr '\n' ' '); none in the loader cache)"
        return 1
    fi
    mkdir -p "$log_dir/lib"
    ln -sf "$(readlink -f "$f")" "$log_dir/lib/libnccl.so"
    export LD_LIBRARY_PATH="$log_dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "libnccl: $f (linked as $log_dir/lib/libnccl.so, first on LD_LIBRARY_PATH)"
}

run() {
    local kit
    kit=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
    local bin=${GPU_KIT_BIN:-$kit/bin}
    deadline=$((SECONDS + ${GPU_KIT_TIME_LIMIT:-170}))
    log_dir=$(mktemp -d) || die "mktemp"
    trap 'rm -rf "$log_dir"' EXIT
    # The executables run from the repository root, as under cargo.
    [ -f "$kit/../Cargo.toml" ] && cd "$kit/.."
    export FSDP_REQUIRE_GPU=1
    [ -f "$kit/MANIFEST" ] && sed 's/^/kit: /' "$kit/MANIFEST"
    echo "machine: $(uname -srm), $(nproc) cores, $(date -u +%FT%TZ)"
    local libs_ok=1
    if find_libcuda; then rows+=("find libcuda|ok|-"); else rows+=("find libcuda|FAIL: not found|-"); libs_ok=0; fi
    if find_nccl; then rows+=("find libnccl|ok|-"); else rows+=("find libnccl|FAIL: not found|-"); libs_ok=0; fi
    [ "$libs_ok" -eq 1 ] || failed=1
    local smi=${GPU_KIT_NVIDIA_SMI:-nvidia-smi}
    if command -v "$smi" >/dev/null; then
        run_step nvidia-smi 20 0 "$smi" --query-gpu=index,name,driver_version,memory.total \
            --format=csv
    else
        rows+=("nvidia-smi|absent (not needed)|-")
    fi
    # The crate's own probe runs even when a library is missing: it says what is missing.
    run_step probe 30 1 "$bin/nccl" --exact probe_names_the_missing_libraries_or_finds_both \
        --nocapture
    local step
    if [ "$libs_ok" -eq 1 ]; then
        run_step nccl 60 4 "$bin/nccl" --test-threads=1 --skip probe_names --skip timed_ \
            --skip fsdp2_
        run_step lib 30 15 "$bin/lib" --test-threads=1 collectives::nccl::
        run_step timed 60 1 "$bin/nccl" --exact timed_device_collectives_of_1_gib --nocapture
        run_step fsdp2 40 1 "$bin/nccl" --exact fsdp2_collectives_through_nccl_equal_the_thread_groups \
            --nocapture
    else
        for step in nccl lib timed fsdp2; do skip_step "$step" "a library is missing"; done
    fi
    echo
    echo "== summary"
    printf '%s\n' "step|status|time" "${rows[@]}" |
        awk -F'|' '{printf "%-14s %-46s %s\n", $1, $2, $3}'
    # What the tests reported: versions, timings, the FSDP2 comparison.
    grep -hE '^(probe|timed|fsdp2): ' "$log_dir"/*.log 2>/dev/null
    if [ "$failed" -ne 0 ]; then
        echo "GPU check FAILED"
        return 1
    fi
    echo "GPU check passed"
}

case "${1:-}" in
build) build ;;
run | "") [ "$(basename "$0")" = run.sh ] || [ "${1:-}" = run ] || die "usage: $0 build | run" ; run ;;
*) die "usage: $0 build (here, CPU) | run (there, GPU; gpu-kit/run.sh)" ;;
esac
