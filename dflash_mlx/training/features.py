"""Target features of the training sequences, computed once and kept on disk.

The target is frozen, so its hidden states at the draft's layers never change
during training: one forward pass per sequence serves every epoch and every
later stage (--resume, --init). They are stored as float16 in a memory-mapped
file next to the draft, keyed by the sequences, layers and target. More data
(the same sequences first, new ones after) computes only the new rows.
"""

import hashlib
import json
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

FILE = "train_features"


def fingerprint(seqs, layer_ids: List[int], seq_len: int, target_desc: str) -> str:
    h = hashlib.sha256(json.dumps([layer_ids, seq_len, target_desc]).encode())
    for s in seqs:
        h.update(np.asarray(s.tokens[:seq_len], dtype=np.int32).tobytes())
        h.update(b"|")
    return h.hexdigest()[:32]


class FeatureStore:
    """Features [N, seq_len, n*H] of N sequences (float16, memory-mapped)."""

    def __init__(self, folder: Path, seqs, target, layer_ids: List[int], seq_len: int,
                 pad: int, batch: int = 4, progress=None):
        self.seq_len = seq_len
        dim = target.hidden_size * len(layer_ids)
        desc = _describe(target, layer_ids)
        key = fingerprint(seqs, layer_ids, seq_len, desc)
        data, meta = folder / f"{FILE}.f16", folder / f"{FILE}.json"
        shape = (len(seqs), seq_len, dim)
        old = _read(meta)
        if old is not None and old.get("key") == key and old.get("done") and data.exists():
            self.array = np.memmap(data, np.float16, "r", shape=shape)
            return
        folder.mkdir(parents=True, exist_ok=True)
        # Rows of an earlier build whose sequences are a prefix of these are kept.
        keep = 0
        if old is not None and old.get("done") and data.exists():
            n = old["shape"][0]
            if n < len(seqs) and tuple(old["shape"][1:]) == shape[1:] \
                    and fingerprint(seqs[:n], layer_ids, seq_len, desc) == old["key"]:
                keep = n
        meta.unlink(missing_ok=True)
        tmp = folder / f"{FILE}.f16.part"
        out = np.memmap(tmp, np.float16, "w+", shape=shape)
        if keep:
            prev = np.memmap(data, np.float16, "r", shape=(keep, *shape[1:]))
            for n in range(0, keep, 64):
                m = min(n + 64, keep)
                out[n:m] = prev[n:m]
            del prev
        # A sequence met before (a repeated record weighs more in training)
        # copies its first row's features instead of computing them again.
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
        for n in range(0, len(order), batch):
            rows = order[n : n + batch]
            S = min(seq_len, max(len(seqs[i].tokens) for i in rows))
            toks = np.full((len(rows), S), pad, dtype=np.int32)
            for b, i in enumerate(rows):
                t = seqs[i].tokens[:S]
                toks[b, : len(t)] = t
            f = target.features(mx.array(toks), layer_ids)
            out[rows, :S] = np.array(f.astype(mx.float16))
            if progress is not None:
                progress(keep + n + len(rows), toks.size)
        for i, j in copies:
            out[i] = out[j]
        if copies and progress is not None:
            progress(len(seqs), 0)
        out.flush()
        del out
        tmp.replace(data)
        meta.write_text(json.dumps({"key": key, "shape": shape, "done": True}) + "\n")
        self.array = np.memmap(data, np.float16, "r", shape=shape)

    def batch(self, index: List[int], length: int) -> mx.array:
        """Float32 features [B, length, n*H] of the sequences ``index``."""
        return mx.array(self.array[np.asarray(index), :length]).astype(mx.float32)


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
