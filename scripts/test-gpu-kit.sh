#!/usr/bin/env bash
# Tests the GPU kit's runner (scripts/gpu-check.sh, gpu-kit/run.sh) on a machine without a GPU:
# library lookup with the libraries absent, in driver folders, in the loader cache (stubs
# refused) and in a fake site-packages (libnccl.so.2 linked as libnccl.so on LD_LIBRARY_PATH),
# the summary table, and the exit status when a step fails, runs no test, or runs out of time.
# The steps are fake executables here; with a built kit as argument (`scripts/test-gpu-kit.sh
# gpu-kit`, as CI runs it after `scripts/gpu-check.sh build`) the real executables also run, and
# must fail with the crate's typed error because this machine has no CUDA driver.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
out=""
rc=0

# run_kit [VAR=value...]: the runner from a kit folder of its own, with fake steps; sets $out, $rc.
mkdir -p "$tmp/kit/bin" "$tmp/empty"
cp "$root/scripts/gpu-check.sh" "$tmp/kit/run.sh"
for step in nccl lib; do
    cat >"$tmp/kit/bin/$step" <<'EOF'
#!/usr/bin/env bash
# A fake libtest executable: says where libnccl.so points, fails or hangs on request.
me=$(basename "$0")
echo "fake $me $* (FSDP_REQUIRE_GPU=${FSDP_REQUIRE_GPU:-unset})"
IFS=: read -ra dirs <<<"${LD_LIBRARY_PATH:-}"
for d in "${dirs[@]}"; do
    [ -e "$d/libnccl.so" ] && echo "libnccl.so on LD_LIBRARY_PATH -> $(readlink -f "$d/libnccl.so")" && break
done
case "$1 $2" in "--exact timed_"*) step=timed ;; "--exact fsdp2_"*) step=fsdp2 ;;
"--exact probe_"*) step=probe ;; *) step=$me ;; esac
[ "${FAKE_HANG:-}" = "$step" ] && sleep 60
[ "$step" = timed ] && echo "timed: all_gather_device 1.00 GiB: fastest 0.400 ms"
[ "$step" = probe ] && echo "probe: CUDA driver libcuda.so.1 (CUDA 13.0); NCCL 2.28.3"
if [ "${FAKE_FAIL:-}" = "$step" ]; then
    echo "test result: FAILED. 0 passed; 1 failed"
    exit 101
fi
echo "test result: ok. ${FAKE_PASSED:-20} passed; 0 failed; 0 ignored; 0 measured; 1 filtered out"
EOF
    chmod +x "$tmp/kit/bin/$step"
done
run_kit() {
    out=$(env GPU_KIT_LDCONFIG="" GPU_KIT_CUDA_DIRS="$tmp/empty" GPU_KIT_SITE_DIRS="$tmp/empty" \
        GPU_KIT_NVIDIA_SMI=no-nvidia-smi-here "$@" "$tmp/kit/run.sh" 2>&1)
    rc=$?
}
check() { # check NAME CONDITION-EXIT-STATUS
    if [ "$2" -ne 0 ]; then
        echo "FAIL: $1"
        echo "--- runner output (exit status $rc):"
        echo "$out"
        echo "---"
        failures=$((failures + 1))
    else
        echo "ok: $1"
    fi
}
has() { grep -qE -- "$1" <<<"$out"; }
row() { grep -qE -- "^$1 +$2" <<<"$out"; } # a summary row: step, then status

# The libraries absent: both named, the probe still runs, the rest is not run, exit 1.
run_kit
[ "$rc" -eq 1 ] && has 'libcuda: not found' && has 'libnccl: not found' &&
    row 'find libcuda' 'FAIL: not found' && row 'find libnccl' 'FAIL: not found' &&
    row probe ok && row nccl 'FAIL: not run' && row fsdp2 'FAIL: not run' &&
    has 'GPU check FAILED' && ! has 'fake nccl --test-threads'
check "libraries absent: exit 1, both named, steps not run" $?

# Found in a driver folder and a fake site-packages holding only libnccl.so.2 (the wheel): the
# link is made, every step runs with FSDP_REQUIRE_GPU=1, the timings follow the table, exit 0.
mkdir -p "$tmp/driver" "$tmp/site/nvidia/nccl/lib" "$tmp/site/torch/lib"
touch "$tmp/driver/libcuda.so.1" "$tmp/site/nvidia/nccl/lib/libnccl.so.2"
run_kit GPU_KIT_CUDA_DIRS="$tmp/empty $tmp/driver" GPU_KIT_SITE_DIRS="$tmp/empty $tmp/site"
[ "$rc" -eq 0 ] && has "libcuda: $tmp/driver/libcuda.so.1 \(added $tmp/driver to LD_LIBRARY_PATH\)" &&
    has "libnccl: $tmp/site/nvidia/nccl/lib/libnccl.so.2 \(linked as" &&
    has "libnccl.so on LD_LIBRARY_PATH -> $tmp/site/nvidia/nccl/lib/libnccl.so.2" &&
    has 'FSDP_REQUIRE_GPU=1' && ! has 'FSDP_REQUIRE_GPU=unset' &&
    row step status && row 'find libcuda' ok && row 'find libnccl' ok && row nvidia-smi absent &&
    row probe ok && row nccl ok && row lib ok && row timed ok && row fsdp2 ok &&
    grep -A20 '^== summary' <<<"$out" | grep -q '^timed: all_gather_device' &&
    grep -A20 '^== summary' <<<"$out" | grep -q '^probe: CUDA driver' &&
    has 'GPU check passed' && [ ! -e "$tmp/site/nvidia/nccl/lib/libnccl.so" ]
check "libraries found: linked, every step ok, exit 0, site-packages untouched" $?

# The loader cache: a stub libcuda (CUDA's link-time one) is passed over for the driver's.
printf '\tlibcuda.so (libc6,x86-64) => /usr/local/cuda/lib64/stubs/libcuda.so\n\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1\n\tlibnccl.so.2 (libc6,x86-64) => %s\n' \
    "$tmp/site/nvidia/nccl/lib/libnccl.so.2" >"$tmp/ldcache"
run_kit GPU_KIT_LDCONFIG="cat $tmp/ldcache"
[ "$rc" -eq 0 ] && has 'libcuda: /usr/lib/x86_64-linux-gnu/libcuda.so.1 \(loader cache\)' &&
    has "libnccl: $tmp/site/nvidia/nccl/lib/libnccl.so.2"
check "loader cache: the driver's libcuda, not the stub; NCCL from the cache" $?

# A stub alone in a driver folder is not a driver.
mkdir -p "$tmp/cuda/lib64/stubs"
touch "$tmp/cuda/lib64/stubs/libcuda.so"
run_kit GPU_KIT_CUDA_DIRS="$tmp/cuda/lib64/stubs" GPU_KIT_SITE_DIRS="$tmp/site"
[ "$rc" -eq 1 ] && has 'libcuda: not found' && row 'find libnccl' ok
check "a stub libcuda alone: not found, exit 1" $?

# Site-packages from Python itself (CUDA 13 wheels keep NCCL under nvidia/cu13/lib).
mkdir -p "$tmp/site13/nvidia/cu13/lib"
touch "$tmp/site13/nvidia/cu13/lib/libnccl.so.2"
printf '#!/bin/sh\necho %s/empty\necho %s/site13\n' "$tmp" "$tmp" >"$tmp/python"
chmod +x "$tmp/python"
out=$(env -u GPU_KIT_SITE_DIRS GPU_KIT_LDCONFIG="" GPU_KIT_CUDA_DIRS="$tmp/driver" \
    GPU_KIT_PYTHON="$tmp/python" GPU_KIT_NVIDIA_SMI=no-nvidia-smi-here "$tmp/kit/run.sh" 2>&1)
rc=$?
[ "$rc" -eq 0 ] && has "libnccl.so on LD_LIBRARY_PATH -> $tmp/site13/nvidia/cu13/lib/libnccl.so.2"
check "site-packages named by Python: the CUDA 13 wheel's folder" $?

# nvidia-smi, when there, is a step of its own.
printf '#!/bin/sh\necho "0, NVIDIA H200, 570.00, 143771 MiB"\n' >"$tmp/nvidia-smi"
chmod +x "$tmp/nvidia-smi"
run_kit GPU_KIT_CUDA_DIRS="$tmp/driver" GPU_KIT_SITE_DIRS="$tmp/site" GPU_KIT_NVIDIA_SMI="$tmp/nvidia-smi"
[ "$rc" -eq 0 ] && has '0, NVIDIA H200, 570.00' && row nvidia-smi ok
check "nvidia-smi output shown and its step ok" $?

# A failing step fails the run; the other steps still run.
run_kit GPU_KIT_CUDA_DIRS="$tmp/driver" GPU_KIT_SITE_DIRS="$tmp/site" FAKE_FAIL=lib
[ "$rc" -eq 1 ] && row lib 'FAIL: exit status 101' && row timed ok && row fsdp2 ok &&
    has 'GPU check FAILED'
check "a failing step: exit 1, named in the table" $?

# A test filter that matches nothing (a renamed test) is a failure, not a pass.
run_kit GPU_KIT_CUDA_DIRS="$tmp/driver" GPU_KIT_SITE_DIRS="$tmp/site" FAKE_PASSED=0
[ "$rc" -eq 1 ] && row probe 'FAIL: 0 tests ran' && row timed 'FAIL: 0 tests ran'
check "no test ran: exit 1" $?

# A hanging step is stopped at the overall limit; later steps have no time left.
start=$SECONDS
run_kit GPU_KIT_CUDA_DIRS="$tmp/driver" GPU_KIT_SITE_DIRS="$tmp/site" FAKE_HANG=timed \
    GPU_KIT_TIME_LIMIT=3
[ "$rc" -eq 1 ] && row timed 'FAIL: timed out after [0-3]s' && row fsdp2 'FAIL: no time left' &&
    [ $((SECONDS - start)) -lt 15 ]
check "a hanging step: stopped within the overall limit, exit 1" $?

# The real kit, when given: its executables fail (never skip) without a CUDA driver.
if [ $# -gt 0 ]; then
    kit=$(cd "$1" && pwd)
    out=$("$kit/run.sh" 2>&1)
    rc=$?
    [ "$rc" -eq 1 ] && row probe 'FAIL: exit status 101' &&
        has 'FSDP_REQUIRE_GPU=1 but NCCL cannot run here: backend `nccl` unavailable' &&
        has 'GPU check FAILED'
    check "the built kit on this CPU machine: the probe fails with the typed error" $?
fi

if [ "$failures" -ne 0 ]; then
    echo "$failures check(s) of the GPU kit's runner failed"
    exit 1
fi
echo "the GPU kit's runner passed every check"
