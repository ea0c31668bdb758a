"""Exception types of dflash_mlx: each says what is wrong and what to do."""

import os
import sys
from typing import Callable


class DFlashError(Exception):
    """Base class of every error dflash_mlx raises on purpose."""


class ModelNotFoundError(DFlashError, FileNotFoundError):
    """A model or draft folder/repo could not be found or fetched."""


class ModelLoadError(DFlashError, ValueError):
    """A target folder exists but cannot be loaded (bad JSON, corrupt weights)."""


class DraftConfigError(DFlashError, ValueError):
    """A draft's config.json is missing, malformed or inconsistent."""


class DraftWeightsError(DFlashError, ValueError):
    """A draft's safetensors are missing, corrupted or do not match its config."""


class IncompatibleDraftError(DFlashError, ValueError):
    """The draft was not made for this target (hidden size, vocabulary, layers)."""


class UnsupportedModelError(DFlashError, ValueError):
    """The target model has a structure dflash_mlx cannot drive."""


class GenerationArgumentError(DFlashError, ValueError):
    """An argument of stream_generate / generate is out of range."""


def run_command(body: Callable[[], int]) -> int:
    """Run a command-line tool's body: an expected error becomes one line on
    stderr and exit code 1, Ctrl-C exit code 130 (DFLASH_DEBUG=1 re-raises)."""
    try:
        return body()
    except KeyboardInterrupt:
        print("\nerror: interrupted", file=sys.stderr)
        return 130
    except (DFlashError, ValueError, OSError) as e:
        if os.environ.get("DFLASH_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1


def exit_now(code: int) -> None:
    """End a tool that ran a model thread (chat, server) with ``code``.

    MLX keeps a compile cache per thread; its destructor takes the GIL, and
    when a worker thread's cache is destroyed while the interpreter shuts down
    the process aborts ("terminate called without an active exception"; seen
    in 7 of 12 chat runs). Flushing and leaving at once skips that teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
