"""Start `python -m dflash_mlx.server` for an example and wait until it answers."""

import subprocess
import sys
import time
from contextlib import contextmanager

from openai import OpenAI


@contextmanager
def served(port: int, *flags: str):
    """An OpenAI client of a server started with ``flags`` (stopped on exit)."""
    server = subprocess.Popen([sys.executable, "-m", "dflash_mlx.server", "--port", str(port), *flags],
                              stderr=subprocess.DEVNULL)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
        for _ in range(600):
            try:
                client.models.list()
                break
            except Exception:
                time.sleep(0.2)
        yield client
    finally:
        server.terminate()
        server.wait()
