"""The `fsdp-ckpt` console script: the Rust tool's command line, run in this process."""

import signal
import sys

from . import _native


def main() -> None:
    """Runs `fsdp-ckpt` with this process's arguments and exits with its status."""
    # Ctrl-C stops the tool at once, as it stops the native executable (the operation runs
    # without the GIL, so Python's own handler would only see it at the end).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.exit(_native.main(["fsdp-ckpt", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
