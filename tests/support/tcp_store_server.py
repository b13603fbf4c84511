"""A real PyTorch 2.13 c10d TCPStore server, the peer of tests/it/tcp_store.rs.

Usage: tcp_store_server.py [libuv|classic]

Starts `torch.distributed.TCPStore(is_master=True)` on 127.0.0.1 with a free port (the libuv
backend, as torchrun's agent runs it, or the classic one), prints `port N`, then serves
commands from stdin, one per line, answering each with one line:

    set KEY HEX    store.set(KEY, bytes.fromhex(HEX))  -> ok
    get KEY        store.get(KEY)                      -> the value in hex

It exits at end of input (when the test process ends).
"""

import sys
from datetime import timedelta

import torch.distributed as dist

backend = sys.argv[1] if len(sys.argv) > 1 else "libuv"
store = dist.TCPStore(
    "127.0.0.1",
    0,
    is_master=True,
    wait_for_workers=False,
    use_libuv=backend == "libuv",
    timeout=timedelta(seconds=30),
)
assert store.libuvBackend == (backend == "libuv")
print(f"port {store.port}", flush=True)
for line in sys.stdin:
    parts = line.split()
    if parts[0] == "set":
        store.set(parts[1], bytes.fromhex(parts[2] if len(parts) > 2 else ""))
        print("ok", flush=True)
    elif parts[0] == "get":
        print(store.get(parts[1]).hex(), flush=True)
    else:
        print(f"unknown command {parts[0]}", flush=True)
