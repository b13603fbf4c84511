"""The Python side of `benches/hf_tensors.rs`: a Hugging Face model directory whose one
`model.safetensors` holds many zero-element tensors (a header near the 100 MB limit), and
Python's own reading of it.

    python benches/hf_tensors_side_by_side.py make DIR N   # DIR/model.safetensors, N tensors
    python benches/hf_tensors_side_by_side.py keys DIR     # safe_open + list the keys, timed
    python benches/hf_tensors_side_by_side.py baseline     # the imports alone

`make` writes the header itself (the bytes `safetensors.torch.save_file` would write for N
float32 tensors of shape [0] named `w.<i>`, `{"format": "pt"}`),
since building N tensors in Python would take longer than the bench, and checks with
`safe_open` that the `safetensors` library reads it. It prints {"header_bytes": ...}.

The timed modes print one JSON line {"seconds": ..., "peak_rss": bytes}, the peak being this
process's ru_maxrss (the interpreter and imports included; `baseline` reports it for the
imports alone). The modules are imported before the clock starts.
"""

import json
import os
import resource
import struct
import sys
import time

from safetensors import safe_open


def name(i):
    return f"w.{i}"


def make(d, n):
    os.makedirs(d, exist_ok=True)
    names = sorted(name(i) for i in range(n))
    parts = ['"__metadata__":{"format":"pt"}']
    parts += [f'"{k}":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}' for k in names]
    header = ("{" + ",".join(parts) + "}").encode()
    header += b" " * (-len(header) % 8)
    path = os.path.join(d, "model.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
    with safe_open(path, "pt") as f:
        assert len(f.keys()) == n
    print(json.dumps({"header_bytes": len(header)}))


def keys(d):
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        ks = list(f.keys())
    assert ks


def peak_rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def timed(fn, *args):
    start = time.perf_counter()
    fn(*args)
    print(json.dumps({"seconds": time.perf_counter() - start, "peak_rss": peak_rss()}))


def main():
    mode = sys.argv[1]
    if mode == "make":
        make(sys.argv[2], int(sys.argv[3]))
    elif mode == "keys":
        timed(keys, sys.argv[2])
    elif mode == "baseline":
        timed(lambda: None)
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
