"""The gateway service: the public API (text in, streamed text out) in front of one or more verifiers."""

import os
import tempfile


def default_address(service: str) -> str:
    """Where a service listens unless told otherwise: a Unix socket in the runtime (or temp) directory."""
    runtime = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return f"unix://{runtime}/treeserve/{service}.sock"
