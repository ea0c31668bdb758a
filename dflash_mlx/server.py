"""`python -m dflash_mlx.server` and the `dflash-server` script: an
OpenAI-compatible HTTP server for DFlash.

The server itself lives in :mod:`dflash_mlx.serve.server` (its batching
scheduler in :mod:`dflash_mlx.serve.scheduler`); this module is only the
entry point.
"""

import sys

from .serve.server import main

if __name__ == "__main__":
    from .blas import preload

    preload("dflash_mlx.server", sys.argv[1:])
    raise SystemExit(main())
