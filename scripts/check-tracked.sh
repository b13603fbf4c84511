#!/usr/bin/env bash
# Fails when git tracks a build output or a file too large to be a fixture: a native module
# (`*.so`, `*.pyd`, `*.dylib`, `*.dll`), an object or archive, a wheel, Python bytecode, or
# anything under a `target/` folder, or any tracked file over 4 MiB. A stale native module in
# the tree can shadow the one a fresh build makes (python/fsdp_ckpt/_native.abi3.so once did),
# and a large tree cannot be sent to the GPU machine (64 MiB limit). Run by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
limit=$((4 * 1024 * 1024))
bad=0
while IFS= read -r -d '' f; do
    case "$f" in
    *.so | *.so.* | *.pyd | *.dylib | *.dll | *.o | *.a | *.rlib | *.whl | *.pyc | \
        */__pycache__/* | __pycache__/* | target/* | */target/*)
        echo "tracked build output: $f" >&2
        bad=1
        continue
        ;;
    esac
    if [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt "$limit" ]; then
        echo "tracked file over 4 MiB: $f ($(stat -c %s "$f") bytes)" >&2
        bad=1
    fi
done < <(git ls-files -z)
if [ "$bad" -ne 0 ]; then
    echo "remove these from git (git rm --cached) and ignore them" >&2
    exit 1
fi
echo "no build output tracked"
