"""Train a DFlash draft for an mlx-lm target: `python -m dflash_mlx.train`."""

import sys
import time

import mlx.optimizers as optim


def make_schedule(lr: float, steps: int, warmup: int):
    """Linear warm-up to ``lr``, then cosine decay to lr/10."""
    warmup = max(1, min(warmup, steps - 1)) if steps > 1 else 1
    up = optim.linear_schedule(lr * 0.01, lr, warmup)
    down = optim.cosine_decay(lr, max(1, steps - warmup), lr * 0.1)
    return optim.join_schedules([up, down], [warmup])


class Progress:
    """A one-line progress bar on stderr: step, rate, ETA and a free text."""

    def __init__(self, total: int, name: str = "train", start: int = 0, out=None):
        self.total, self.name, self.start = total, name, start
        self.out = out or sys.stderr
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.last = 0.0

    def update(self, step: int, tokens: int, text: str = "", force: bool = False):
        self.tokens += tokens
        now = time.perf_counter()
        if not force and now - self.last < 0.5 and step < self.total:
            return
        self.last = now
        dt = max(now - self.t0, 1e-9)
        done = step - self.start
        eta = (self.total - step) * dt / max(done, 1)
        line = (
            f"\r{self.name} {step}/{self.total} | {text} | "
            f"{self.tokens / dt:,.0f} tok/s | ETA {_hms(eta)}"
        )
        tty = getattr(self.out, "isatty", lambda: False)()
        if tty:
            self.out.write(line + "\x1b[K")
        elif force or step == self.total or done % max(1, self.total // 50) == 0:
            self.out.write(line[1:] + "\n")
        self.out.flush()

    def close(self):
        if getattr(self.out, "isatty", lambda: False)():
            self.out.write("\n")
        self.out.flush()


def _hms(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
