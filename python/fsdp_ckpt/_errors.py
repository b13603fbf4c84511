"""The exception every operation of the package raises for bad input or a failed operation."""

import json
from typing import Any, Optional


class Error(Exception):
    """An error of the `fsdp` crate, raised by every `fsdp_ckpt` operation.

    ``str(e)`` is the crate's message, naming what was wrong and where (file, key, parameter,
    rank). ``e.kind`` is the crate's error variant (``"Io"``, ``"ShapeMismatch"``,
    ``"DcpStorage"``, ``"WorldSizeMismatch"``, ...), ``e.detail`` its typed fields as a dict
    (``None`` when it has none), and ``e.io_kind`` the OS error kind of an ``"Io"`` error
    (``"NotFound"``, ``"PermissionDenied"``, ...).
    """

    def __init__(self, message: str, kind: str = "Error", detail: Any = None):
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.detail = detail

    @property
    def io_kind(self) -> Optional[str]:
        """The OS error kind of an ``Io`` error, else ``None``."""
        if self.kind != "Io" or not isinstance(self.detail, dict):
            return None
        source = self.detail.get("source")
        return source.get("kind") if isinstance(source, dict) else None

    def __repr__(self) -> str:
        return f"fsdp_ckpt.Error(kind={self.kind!r}, message={self.message!r})"


def _from_native(message: str, kind: str, detail_json: str) -> Error:
    """Called by the native module to build the exception of a crate error."""
    return Error(message, kind, json.loads(detail_json))
