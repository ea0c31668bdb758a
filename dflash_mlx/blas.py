"""Run command-line tools with the system OpenBLAS on Linux.

MLX's CPU wheel links a reference BLAS about 30x slower than OpenBLAS, and the
library must be preloaded before the process starts, so a tool re-executes
itself once with LD_PRELOAD set. Nothing happens on macOS, when OpenBLAS is
absent, or when it is already loaded.
"""

import os
import sys
from typing import List

LIBS = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
)


def preload(module: str, argv: List[str]) -> None:
    """Re-run ``python -m module argv`` with OpenBLAS preloaded, if useful."""
    if sys.platform != "linux" or os.environ.get("DFLASH_NO_REEXEC"):
        return
    lib = next((x for x in LIBS if os.path.exists(x)), None)
    if lib is None or lib in os.environ.get("LD_PRELOAD", ""):
        return
    env = dict(os.environ, DFLASH_NO_REEXEC="1")
    env["LD_PRELOAD"] = ":".join(filter(None, [lib, env.get("LD_PRELOAD")]))
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)
