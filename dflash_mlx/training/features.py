"""Target features and exact labels of the training sequences, computed once
and kept on disk.

The target is frozen, so its hidden states at the draft's layers never change
during training: one forward pass per sequence serves every epoch and every
later stage (--resume, --init). The same pass gives each position's greedy
label (:mod:`.labels`). Features are stored as float16 and labels as int32 in
memory-mapped files next to the draft, keyed by the sequences, layers and
target. More data (the same sequences first, new ones after) computes only
the new rows; an interrupted build goes on from the batches it had finished;
``workers`` > 1 computes it in that many processes of one thread each.
"""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .labels import greedy_labels

FILE = "train_features"
VERSION = 2  # 2: labels beside the features


def fingerprint(seqs, layer_ids: List[int], seq_len: int, target_desc: str) -> str:
    h = hashlib.sha256(json.dumps([VERSION, layer_ids, seq_len, target_desc]).encode())
    for s in seqs:
        h.update(np.asarray(s.tokens[:seq_len], dtype=np.int32).tobytes())
        h.update(b"|")
    return h.hexdigest()[:32]


class FeatureStore:
    """Features [N, seq_len, n*H] (float16) and greedy labels [N, seq_len]
    (int32) of N sequences, memory-mapped.

    Args:
        folder: Where the files are kept.
        seqs: The training sequences.
        target: The :class:`.engine.target.Target`.
        layer_ids: The target layers whose outputs are the features.
        seq_len: Tokens kept of each sequence.
        pad: The token that pads a batch.
        batch: Sequences per forward pass.
        progress: Called with (rows done, tokens of the last batch).
        workers: Processes that compute the rows (needs ``model``).
        model: The target's path or name, for the workers to load it.
    """

    def __init__(self, folder: Path, seqs, target, layer_ids: List[int], seq_len: int,
                 pad: int, batch: int = 4, progress=None, workers: int = 1, model: Optional[str] = None):
        self.seq_len = seq_len
        dim = target.hidden_size * len(layer_ids)
        desc = _describe(target, layer_ids)
        key = fingerprint(seqs, layer_ids, seq_len, desc)
        data, labels, meta = folder / f"{FILE}.f16", folder / f"{FILE}.labels", folder / f"{FILE}.json"
        shape = (len(seqs), seq_len, dim)
        old = _read(meta)
        if old is not None and old.get("key") == key and old.get("done") and data.exists():
            self._open(data, labels, shape)
            return
        folder.mkdir(parents=True, exist_ok=True)
        part, lpart = folder / f"{FILE}.f16.part", folder / f"{FILE}.labels.part"
        # Batches finished by an interrupted build of these very rows are kept.
        resume = old is not None and old.get("key") == key and part.exists() and lpart.exists()
        done = _done(folder) if resume else set()
        # Rows of an earlier build whose sequences are a prefix of these are kept.
        keep = 0
        if not resume and old is not None and old.get("done") and data.exists():
            n = old["shape"][0]
            if n < len(seqs) and tuple(old["shape"][1:]) == shape[1:] \
                    and fingerprint(seqs[:n], layer_ids, seq_len, desc) == old["key"]:
                keep = n
        if not resume:
            for f in folder.glob(f"{FILE}.done*"):
                f.unlink()
            meta.write_text(json.dumps({"key": key, "shape": shape, "done": False, "keep": keep}) + "\n")
        keep = old.get("keep", 0) if resume else keep
        out = np.memmap(part, np.float16, "r+" if resume else "w+", shape=shape)
        lout = np.memmap(lpart, np.int32, "r+" if resume else "w+", shape=shape[:2])
        if keep and not resume:
            prev = np.memmap(data, np.float16, "r", shape=(keep, *shape[1:]))
            plab = np.memmap(labels, np.int32, "r", shape=(keep, seq_len))
            for n in range(0, keep, 64):
                m = min(n + 64, keep)
                out[n:m], lout[n:m] = prev[n:m], plab[n:m]
            del prev, plab
            out.flush()
            lout.flush()
        # A sequence met before (a repeated record weighs more in training)
        # copies its first row instead of computing it again.
        first, copies, order = {}, [], []
        for i, s in enumerate(seqs):
            k = tuple(s.tokens[:seq_len])
            if k not in first:
                first[k] = i
                if i >= keep:
                    order.append(i)
            elif i >= keep:
                copies.append((i, first[k]))
        # Sequences of similar length share a batch, so little padding is computed.
        order.sort(key=lambda i: len(seqs[i].tokens))
        batches = [order[n : n + batch] for n in range(0, len(order), batch)]
        todo = [b for b in range(len(batches)) if b not in done]
        rows = np.full((len(seqs), seq_len), pad, dtype=np.int32)
        for i in order:
            t = seqs[i].tokens[:seq_len]
            rows[i, : len(t)] = t
        lengths = np.array([min(len(s.tokens), seq_len) for s in seqs])
        del out, lout
        job = dict(folder=str(folder), shape=shape, batches=batches, layer_ids=layer_ids, rows=rows,
                   lengths=lengths)
        count = [keep + sum(len(batches[b]) for b in done)]

        def on_batch(rows, tokens):
            count[0] += rows
            if progress is not None:
                progress(count[0], tokens)

        if workers > 1 and model is not None and len(todo) > 1:
            _spawn(job, todo, workers, model, on_batch)
        else:
            compute(job, todo, target, on_batch)
        out = np.memmap(part, np.float16, "r+", shape=shape)
        lout = np.memmap(lpart, np.int32, "r+", shape=shape[:2])
        for i, j in copies:
            out[i], lout[i] = out[j], lout[j]
        out.flush()
        lout.flush()
        del out, lout
        part.replace(data)
        lpart.replace(labels)
        for f in folder.glob(f"{FILE}.done*"):
            f.unlink()
        meta.write_text(json.dumps({"key": key, "shape": shape, "done": True}) + "\n")
        self._open(data, labels, shape)

    def _open(self, data: Path, labels: Path, shape) -> None:
        self.array = np.memmap(data, np.float16, "r", shape=shape)
        self.labels = np.memmap(labels, np.int32, "r", shape=shape[:2])

    def batch(self, index: List[int], length: int) -> mx.array:
        """Float32 features [B, length, n*H] of the sequences ``index``."""
        return mx.array(self.array[np.asarray(index), :length]).astype(mx.float32)


def compute(job: dict, todo: List[int], target, on_batch=None, worker: int = 0) -> None:
    """Compute the batches ``todo`` of ``job`` into the store's part files,
    noting each finished batch (flushed first) in this worker's done file;
    ``on_batch(rows, tokens)`` after each."""
    folder, shape = Path(job["folder"]), tuple(job["shape"])
    out = np.memmap(folder / f"{FILE}.f16.part", np.float16, "r+", shape=shape)
    lout = np.memmap(folder / f"{FILE}.labels.part", np.int32, "r+", shape=shape[:2])
    with open(folder / f"{FILE}.done{worker}", "a") as log:
        for b in todo:
            rows = job["batches"][b]
            S = int(max(job["lengths"][i] for i in rows))
            toks = mx.array(np.asarray(job["rows"])[rows, :S])
            labels, f = greedy_labels(target, toks, job["layer_ids"])
            out[rows, :S] = np.array(f.astype(mx.float16))
            lout[rows, :S] = np.array(labels)
            out.flush()
            lout.flush()
            log.write(f"{b}\n")
            log.flush()
            if on_batch is not None:
                on_batch(len(rows), toks.size)


def _done(folder: Path) -> set:
    done = set()
    for f in folder.glob(f"{FILE}.done*"):
        for line in f.read_text().splitlines():
            if line.strip().isdigit():
                done.add(int(line))
    return done


def _spawn(job: dict, todo: List[int], workers: int, model: str, on_batch) -> None:
    """Run ``compute`` in ``workers`` processes of one thread each, sharing
    ``todo`` between them; their progress comes back on their stdout."""
    import selectors

    folder = Path(job["folder"])
    np.savez(folder / f"{FILE}.job.npz", rows=job["rows"], lengths=job["lengths"])
    meta = {k: job[k] for k in ("folder", "shape", "batches", "layer_ids")}
    (folder / f"{FILE}.job.json").write_text(json.dumps(dict(meta, model=model)))
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", DFLASH_NO_REEXEC="1")
    procs = [subprocess.Popen([sys.executable, "-m", __name__, str(folder), str(w),
                               ",".join(map(str, todo[w::workers]))], env=env, stdout=subprocess.PIPE, text=True)
             for w in range(workers)]
    sel = selectors.DefaultSelector()
    for p in procs:
        sel.register(p.stdout, selectors.EVENT_READ)
    left = len(procs)
    while left:
        for k, _ in sel.select():
            line = k.fileobj.readline()
            if not line:
                sel.unregister(k.fileobj)
                left -= 1
            elif on_batch is not None and re.fullmatch(r"\d+ \d+\n?", line):
                on_batch(*map(int, line.split()))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"A feature worker failed (exit codes {codes}); run again to go on from where it stopped.")
    for f in (f"{FILE}.job.npz", f"{FILE}.job.json"):
        (folder / f).unlink()


def _worker(folder: str, worker: int, todo: str) -> None:
    from ..engine.target import Target
    from ..models.loading import load

    meta = json.loads((Path(folder) / f"{FILE}.job.json").read_text())
    arrays = np.load(Path(folder) / f"{FILE}.job.npz")
    job = dict(meta, rows=arrays["rows"], lengths=arrays["lengths"])
    model, _ = load(meta["model"])
    compute(job, [int(b) for b in todo.split(",") if b], Target(model),
            lambda rows, toks: print(rows, toks, flush=True), worker)


def _describe(target, layer_ids: List[int]) -> str:
    """The target's shape and a digest of the start of every weight that
    feeds ``layer_ids``: another target of the same shape (a fine-tune, a
    quantization) does not reuse these features."""
    h = hashlib.sha256()
    for m in [target.embed] + target.layers[: max(layer_ids) + 1]:
        for name, w in tree_flatten(m.parameters()):
            w = w.reshape(-1)[:256]
            h.update(name.encode() + str(w.dtype).encode())
            h.update(np.array(w.astype(mx.float32) if w.dtype == mx.bfloat16 else w).tobytes())
    return f"{target.num_layers}x{target.hidden_size}:{h.hexdigest()[:16]}"


def _read(meta: Path) -> Optional[dict]:
    try:
        return json.loads(meta.read_text())
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), sys.argv[3])
