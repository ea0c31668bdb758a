"""Train a DFlash draft for an mlx-lm target: `python -m dflash_mlx.train`.

The recipe is the published one: the target is frozen and supplies features at
the chosen layers, its embedding and its LM head; many random anchor blocks per
sequence are trained at once (each sees the context strictly before its anchor
and its own block, bidirectionally); offset k predicts the token at anchor + k
with loss weight exp(-(k-1)/gamma); AdamW, cosine schedule with warm-up,
gradient clipping at 1.0.
"""

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..models.config import DFlashConfig, default_layer_ids
from .data import DataError, Sequence, read_records, regen_prompts, regenerate, sequences
from ..engine.draft import DFlashDraft
from .features import FeatureStore
from .fastmath import cross_entropy, numpy_exp
from .labels import block_labels, greedy_labels
from ..errors import DFlashError, run_command
from ..models.loading import load, load_draft, save_draft
from ..engine.target import Target, model_args


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
        self.shown = -1  # the last 1/50th of the run written to a non-terminal

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
        fiftieth = done * 50 // max(self.total - self.start, 1)
        if tty:
            self.out.write(line + "\x1b[K")
        elif force or step == self.total or fiftieth > self.shown:
            self.shown = fiftieth
            self.out.write(line[1:] + "\n")
        self.out.flush()

    def close(self):
        if getattr(self.out, "isatty", lambda: False)():
            self.out.write("\n")
        self.out.flush()


def _hms(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


STATE = "train_state"
REGEN = "train_regenerated.jsonl"  # kept for --resume; not part of the draft


class TrainError(DFlashError, ValueError):
    """A training option does not fit the target or the data."""


@dataclass
class TrainArgs:
    block_size: int = 16
    depth: int = 5
    target_layer_ids: Optional[List[int]] = None
    mask_token_id: Optional[int] = None
    seq_len: int = 512
    anchors: int = 32
    batch_size: int = 8
    steps: Optional[int] = None
    epochs: float = 1.0
    minutes: Optional[float] = None
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.01
    gamma: Optional[float] = None
    seed: int = 0
    checkpoint_every: int = 500
    init: Optional[str] = None  # start from this draft's weights (fine-tuning)
    decode_anchors: bool = False  # train on the blocks decoding would start next
    draft_vocab: int = 0  # propose from the K most frequent target tokens (0: all)
    cache_features: bool = True  # target features computed once, kept in the output folder
    target_init: bool = False  # draft layers start as copies of the target's last layers
    context_window: Optional[int] = None  # the draft attends to at most this many past positions
    labels: str = "target"  # "target": the target's greedy tokens (exact, see labels.py); "text": the text's own
    data_workers: int = 1  # processes computing the feature store (one thread each)


def default_gamma(block_size: int) -> float:
    """Loss decay of the published recipe: 7 for bs 16, 5 for 10, 4 for 8."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size / 2 - 1))


def mask_token(model, tokenizer, given: Optional[int]) -> int:
    """The draft's mask id: ``given``, else the first padded embedding row."""
    rows = Target(model).vocab_rows
    if given is not None:
        if not 0 <= given < rows:
            raise TrainError(f"--mask-token-id {given} is outside the embedding table ({rows} rows).")
        return given
    n = len(tokenizer._tokenizer) if hasattr(tokenizer, "_tokenizer") else len(tokenizer)
    if n < rows:
        return n
    spare = unused_special(tokenizer)
    if spare is not None and spare < rows:
        return spare
    raise TrainError(
        f"The target's embedding table ({rows} rows) has no spare row beyond the "
        f"tokenizer's {n} tokens; pass --mask-token-id with an unused token id."
    )


def unused_special(tokenizer) -> Optional[int]:
    """The last special token that is neither bos/eos/pad/unk nor in the chat
    template (e.g. SmolLM2's ``<empty_output>``), or None."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    added = getattr(hf, "added_tokens_decoder", {}) or {}
    template = getattr(hf, "chat_template", None) or ""
    used = {getattr(hf, f"{k}_token", None) for k in ("bos", "eos", "pad", "unk")}
    free = [i for i, t in added.items()
            if getattr(t, "special", False) and str(t) not in used and str(t) not in template]
    return max(free) if free else None


def draft_config(model, tokenizer, a: TrainArgs) -> DFlashConfig:
    """A draft config matching the target's width, heads and RoPE."""
    t = Target(model)
    ma = model_args(model)
    H, T = t.hidden_size, t.num_layers
    heads = ma.get("num_attention_heads") or max(1, H // 64)
    ids = a.target_layer_ids or default_layer_ids(T, a.depth)
    bad = [i for i in ids if not 0 <= i < T]
    if bad:
        raise TrainError(f"--target-layer-ids {bad} out of range: the target has {T} layers.")
    return DFlashConfig(
        hidden_size=H,
        num_hidden_layers=a.depth,
        num_attention_heads=heads,
        num_key_value_heads=ma.get("num_key_value_heads") or heads,
        head_dim=ma.get("head_dim") or H // heads,
        intermediate_size=ma.get("intermediate_size") or 3 * H,
        vocab_size=t.vocab_rows,
        mask_token_id=mask_token(model, tokenizer, a.mask_token_id),
        target_layer_ids=list(ids),
        num_target_layers=T,
        rms_norm_eps=ma.get("rms_norm_eps") or 1e-6,
        rope_theta=float(ma.get("rope_theta") or 1e6),
        rope_scaling=ma.get("rope_scaling") if isinstance(ma.get("rope_scaling"), dict) else None,
        max_position_embeddings=ma.get("max_position_embeddings") or 40960,
        block_size=a.block_size,
        layer_types=["sliding_attention"] * a.depth if a.context_window else None,
        sliding_window=a.context_window,
    )


def make_batch(seqs: List[Sequence], a: TrainArgs, pad: int, mask_id: int, rng, given=None, lookup=None,
               greedy=None):
    """Token matrix [B, S], blocks [B*nA, bs], anchors [B*nA], labels and
    validity [B*nA, bs-1]: block j of sequence b is row b*nA + j. Anchors are
    drawn at random unless given ([B, nA]). With ``lookup`` (token id -> row
    of the draft's vocabulary, or -1) labels are draft-vocabulary rows and
    tokens outside it are not trained on. With ``greedy`` ([B, >= S]: the
    target's greedy token after each position) the labels are those, valid
    up to the text's first step off the greedy path (:mod:`.labels`)."""
    bs, nA = a.block_size, a.anchors
    S = max(len(s.tokens[: a.seq_len]) for s in seqs)
    toks = np.full((len(seqs), S + bs), pad, dtype=np.int32)
    anchors = np.zeros((len(seqs), nA), dtype=np.int32)
    valid = np.zeros((len(seqs), nA, bs - 1), dtype=bool)
    for b, s in enumerate(seqs):
        t = s.tokens[: a.seq_len]
        toks[b, : len(t)] = t
        lo, hi = max(0, min(s.start, len(t) - 1) - 1), len(t) - 2
        span = hi - lo + 1
        pick = rng.choice(span, size=nA, replace=span < nA) + lo if given is None else given[b]
        anchors[b] = pick
        k = np.arange(1, bs)
        valid[b] = pick[:, None] + k[None] < len(t)
    idx = anchors[..., None] + np.arange(bs)
    blocks = np.take_along_axis(toks[:, None, :], idx, axis=2)  # [B, nA, bs]
    labels = blocks[..., 1:].reshape(-1, bs - 1).copy()
    if greedy is not None:
        labels = labels.reshape(len(seqs), nA, bs - 1)
        for b, s in enumerate(seqs):
            n = len(s.tokens[: a.seq_len])
            labels[b], valid[b] = block_labels(toks[b], np.asarray(greedy[b]), n, anchors[b], bs)
        labels = labels.reshape(-1, bs - 1)
    if lookup is not None:
        labels = lookup[labels]
        valid &= labels.reshape(valid.shape) >= 0
        labels = np.maximum(labels, 0)
    blocks[..., 1:] = mask_id
    return (
        mx.array(toks[:, :S]),
        mx.array(blocks.reshape(-1, bs)),
        mx.array(anchors.reshape(-1)),
        mx.array(labels),
        mx.array(valid.reshape(-1, bs - 1)),
    )


def block_logits(draft: DFlashDraft, target: Target, features, blocks, anchors):
    """Training-path logits [B*nA, bs-1, V] of every anchor block (V: the
    draft's vocabulary)."""
    h = draft(target.embed(blocks), features, anchors=anchors)
    vocab = draft.config.draft_vocab
    return (target.head_over(mx.array(vocab)) if vocab else target.head)(h[:, 1:])


def top_tokens(seqs: List[Sequence], k: int, rows: int) -> List[int]:
    """The ``k`` most frequent target tokens of ``seqs`` (a draft vocabulary)."""
    toks = np.concatenate([np.asarray(s.tokens[s.start :], dtype=np.int64) for s in seqs])
    counts = np.bincount(toks, minlength=rows)
    return sorted(np.argsort(-counts, kind="stable")[:k].tolist())


def loss_fn(draft, target, features, blocks, anchors, labels, valid, weights):
    """Offset-weighted cross entropy, the accuracy per offset and the mean
    accepted prefix length of the blocks (a training estimate of tau)."""
    logits = block_logits(draft, target, features, blocks, anchors)
    ce = cross_entropy(logits, labels)
    w = weights[None] * valid
    loss = (ce * w).sum() / mx.maximum(w.sum(), 1e-6)
    hit = (mx.argmax(logits, axis=-1) == labels) & valid
    acc = hit.sum(0) / mx.maximum(valid.sum(0), 1)
    tau = 1 + mx.cumprod(hit.astype(mx.float32), axis=1).sum(1).mean()
    return loss, (acc, tau)


def next_anchors(draft, target, features, blocks, anchors, labels, valid, seqs, a: TrainArgs):
    """Where decoding would start the block after each anchor block: just past
    its accepted drafts, at the bonus token ([B, nA]; a block whose successor
    would leave its sequence keeps its anchor). Decoding only ever starts
    blocks there, right after a miss, and those are harder than random
    anchors in the middle of easy runs."""
    logits = block_logits(draft, target, features, blocks, anchors)
    hit = (mx.argmax(logits, axis=-1) == labels) & valid
    new = anchors + 1 + mx.cumprod(hit.astype(mx.int32), axis=1).sum(1)
    new, old = np.array(new).reshape(len(seqs), -1), np.array(anchors).reshape(len(seqs), -1)
    last = np.array([len(s.tokens[: a.seq_len]) - 2 for s in seqs])[:, None]
    return np.where(new <= last, new, old)


def _features(target: Target, toks, layer_ids):
    _, f = target.hidden(toks, layer_ids)
    return mx.stop_gradient(f)


def train(model, tokenizer, seqs: List[Sequence], out: str, a: TrainArgs, resume: bool = False,
          log=None, on_step=None, model_path: Optional[str] = None, features_only: bool = False):
    """Train a draft for ``model`` on ``seqs`` and save it (z-lab format) in ``out``.

    The target stays frozen; it supplies the features, the embedding of the
    blocks and the LM head. ``on_step(step, loss, acc, tau)`` is called after
    every step. ``model_path``: where ``model`` was loaded from, for feature
    workers (``a.data_workers``) to load it too. Returns the trained draft
    (``features_only``: build the feature store and return None).
    """
    log, outp = log or sys.stderr, Path(out)
    if not seqs:
        raise DataError("No training sequences (every record was shorter than 2 tokens).")
    if a.block_size < 2:
        raise TrainError("--block-size must be at least 2.")
    target = Target(model)
    model.freeze()
    src = load_draft(a.init) if a.init else None
    if src is not None:
        a = _inherit(a, src.config)
    draft = _new_draft(model, tokenizer, target, seqs, a, src, outp, resume)
    pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    store = _feature_store(target, draft.config, seqs, a, pad, outp, log, model_path) if a.cache_features else None
    if features_only:
        return None
    scale = _scale(target, draft.config, seqs, a, pad, store)
    if src is not None:
        draft.fc.weight = draft.fc.weight * scale[None]
    inputs = _inputs(target, draft, seqs, a, pad, store, 1 / scale)
    grad_fn = _grad_fn(model, target, draft, a)
    steps = a.steps or max(1, math.ceil(a.epochs * len(seqs) / a.batch_size))
    if a.minutes and not a.steps:
        steps = _steps_in(a.minutes, grad_fn, inputs, seqs, a, log)
    opt = optim.AdamW(make_schedule(a.lr, steps, int(a.warmup * steps)), weight_decay=a.weight_decay)
    opt.init(draft.trainable_parameters())
    step = 0
    if resume:
        step = _load_state(draft, opt, outp)
        draft.fc.weight = draft.fc.weight * scale[None]
        print(f"resuming at step {step}/{steps}", file=log)
    for done in _run_steps(draft, opt, grad_fn, inputs, seqs, a, step, steps, log, on_step):
        if a.checkpoint_every and done % a.checkpoint_every == 0 and done < steps:
            _save(draft, opt, outp, done, scale)
    _save(draft, opt, outp, steps, scale)
    draft.fc.weight = draft.fc.weight / scale[None]
    return draft


def _new_draft(model, tokenizer, target: Target, seqs: List[Sequence], a: TrainArgs, src: Optional[DFlashDraft],
               out: Path, resume: bool) -> DFlashDraft:
    """The draft to train: a new one (started from the target's norm, and its
    last layers with ``a.target_init``) or the --init draft ``src`` in float32.
    Its vocabulary: ``src``'s, the one it was trained with when resuming, or
    the ``a.draft_vocab`` most frequent tokens of ``seqs``."""
    cfg = draft_config(model, tokenizer, a)
    saved = out / "config.json"
    if src is not None:
        cfg.draft_vocab = src.config.draft_vocab
    elif resume and saved.exists():  # the vocabulary it was trained with
        cfg.draft_vocab = DFlashConfig.from_file(saved).draft_vocab
    elif a.draft_vocab and a.draft_vocab < cfg.vocab_size:
        cfg.draft_vocab = top_tokens(seqs, a.draft_vocab, cfg.vocab_size)
    mx.random.seed(a.seed)
    draft = DFlashDraft(cfg)
    if src is None:
        _from_target(draft, target, a.target_init)
    if src is not None:
        _check_init(src.config, cfg, a.init)
        draft.update(src.parameters())
        draft.set_dtype(mx.float32)
        w = float32_weights(Path(a.init))
        if w is not None:  # a draft of ours: its exact weights, not the bf16 copy
            draft.update(tree_unflatten(list(w.items())))
    mx.eval(draft.parameters())
    return draft


def _feature_store(target: Target, cfg: DFlashConfig, seqs: List[Sequence], a: TrainArgs, pad: int, out: Path,
                   log, model_path: Optional[str]) -> FeatureStore:
    """The target's features of ``seqs``, computed once into ``out``."""
    bar = Progress(len(seqs), "features", out=log)
    store = FeatureStore(out, seqs, target, cfg.target_layer_ids, a.seq_len, pad,
                         progress=lambda n, t: bar.update(n, t), workers=a.data_workers, model=model_path)
    bar.close()
    return store


def _scale(target: Target, cfg: DFlashConfig, seqs: List[Sequence], a: TrainArgs, pad: int,
           store: Optional[FeatureStore]) -> mx.array:
    """The per-dimension RMS of the target's features, from the first sequences.

    The draft trains on features divided by it, and its fc weights are folded
    back on saving: targets with massive activations (SmolLM2: dims of RMS
    ~1900 beside a median of ~6) otherwise drown the context in a few
    dimensions and Adam's steps on them."""
    if store is not None:
        return feature_scale(store.array[: min(64, len(seqs))])
    toks = make_batch(seqs[: a.batch_size], a, pad, cfg.mask_token_id, np.random.default_rng(0))[0]
    return feature_scale(np.array(_features(target, toks, cfg.target_layer_ids)))


def _inputs(target: Target, draft: DFlashDraft, seqs: List[Sequence], a: TrainArgs, pad: int,
            store: Optional[FeatureStore], inv: mx.array):
    """``inputs(index, rng)``: the features (times ``inv``), blocks, anchors,
    labels and validity of one step on ``seqs[index]``."""
    cfg = draft.config
    lookup = None
    if cfg.draft_vocab:
        lookup = np.full(cfg.vocab_size, -1, dtype=np.int32)
        lookup[cfg.draft_vocab] = np.arange(len(cfg.draft_vocab), dtype=np.int32)

    def inputs(index, rng):
        batch = [seqs[i] for i in index]
        toks, *blocks = make_batch(batch, a, pad, cfg.mask_token_id, rng, lookup=lookup)
        greedy = None
        if store is not None:
            feats = store.batch(index, toks.shape[1])
            greedy = store.labels[np.asarray(index)] if a.labels == "target" else None
        elif a.labels == "target":
            greedy, feats = greedy_labels(target, toks, cfg.target_layer_ids)
            greedy, feats = np.array(greedy), mx.stop_gradient(feats)
        else:
            feats = _features(target, toks, cfg.target_layer_ids)
        feats = feats * inv
        if greedy is not None:  # the same anchors, the target's labels
            anchors = np.array(blocks[1]).reshape(len(batch), -1)
            _, *blocks = make_batch(batch, a, pad, cfg.mask_token_id, rng, anchors, lookup, greedy)
        if a.decode_anchors:
            moved = next_anchors(draft, target, feats, *blocks, batch, a)
            _, *blocks = make_batch(batch, a, pad, cfg.mask_token_id, rng, moved, lookup, greedy)
        return (feats, *blocks)

    return inputs


def _grad_fn(model, target: Target, draft: DFlashDraft, a: TrainArgs):
    """``grad_fn(feats, blocks, anchors, labels, valid)``: ((loss, (acc, tau)),
    gradients) of the draft, offset k weighted by exp(-(k-1)/gamma)."""
    gamma = a.gamma or default_gamma(a.block_size)
    weights = mx.exp(-mx.arange(a.block_size - 1, dtype=mx.float32) / gamma)
    grad = nn.value_and_grad(draft, loss_fn)

    def grad_fn(feats, blocks, anchors, labels, valid):
        with numpy_exp(model, draft):  # MLX-CPU's exp is slow; decoding never runs this
            return grad(draft, target, feats, blocks, anchors, labels, valid, weights)

    return grad_fn


def _steps_in(minutes: float, grad_fn, inputs, seqs: List[Sequence], a: TrainArgs, log) -> int:
    """How many steps fit in ``minutes``, from the time of one."""
    rng = np.random.default_rng(a.seed)
    for _ in range(2):  # the first call pays one-time costs
        tic = time.perf_counter()
        mx.eval(grad_fn(*inputs(range(min(a.batch_size, len(seqs))), rng)))
    steps = max(1, int(minutes * 60 / ((time.perf_counter() - tic) * 1.1)))
    print(f"{steps} steps fit in {minutes:g} min", file=log)
    return steps


def _run_steps(draft: DFlashDraft, opt, grad_fn, inputs, seqs: List[Sequence], a: TrainArgs, step: int, steps: int,
           log, on_step):
    """Run steps ``step`` to ``steps`` on batches of ``seqs`` shuffled once an
    epoch, showing their progress; yield the number done after each."""
    rng = np.random.default_rng(a.seed + step)
    order = rng.permutation(len(seqs))
    pos = (step * a.batch_size) % len(seqs)
    bar = Progress(steps, "train", start=step, out=log)
    ema = None
    for step in range(step, steps):
        if pos + a.batch_size > len(order):
            order, pos = rng.permutation(len(seqs)), 0
        index = order[pos : pos + a.batch_size]
        pos += a.batch_size
        feats, blocks, anchors, labels, valid = inputs(index, rng)
        (loss, (acc, tau)), g = grad_fn(feats, blocks, anchors, labels, valid)
        g, _ = optim.clip_grad_norm(g, 1.0)
        opt.update(draft, g)
        mx.eval(draft.parameters(), opt.state, loss, acc, tau)
        if on_step is not None:
            on_step(step + 1, loss.item(), acc.tolist(), tau.item())
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        accs = acc.tolist()
        shown = " ".join(f"@{k}:{accs[k - 1]:.2f}" for k in (1, 2, 4, 8, 15) if k <= len(accs))
        bar.update(step + 1, blocks.size + feats.shape[0] * feats.shape[1], f"loss {ema:.3f} acc {shown} tau~{tau.item():.2f}")
        yield step + 1
    bar.close()


def feature_scale(feats) -> mx.array:
    """Per-dimension RMS of target features [B, S, D] over the filled
    positions after the first (which holds attention-sink outliers)."""
    f = np.asarray(feats[:, 1:], dtype=np.float32).reshape(-1, feats.shape[-1])
    f = f[np.abs(f).sum(1) > 0]
    rms = np.sqrt((f**2).mean(0)) if len(f) else np.ones(feats.shape[-1], np.float32)
    return mx.array(np.maximum(rms, 1e-2))


def _from_target(draft: DFlashDraft, target: Target, layers: bool) -> None:
    """Start the output norm (and, with ``layers``, each draft layer) from the
    target's own: the LM head expects the target's final norm scale, and the
    target's last layers already work in the residual space the draft writes."""
    norm = getattr(target.inner, "norm", None)
    if norm is not None and norm.weight.shape == draft.norm.weight.shape:
        draft.norm.weight = mx.array(norm.weight)
    if not layers:
        return
    names = dict(tree_flatten(draft.layers[0].parameters()))
    for d, t in zip(draft.layers, target.layers[-len(draft.layers):]):
        have = dict(tree_flatten(t.parameters()))
        d.update(tree_unflatten([(k, mx.array(have[k])) for k, v in names.items()
                                 if k in have and have[k].shape == v.shape]))


def _inherit(a: TrainArgs, src: DFlashConfig) -> TrainArgs:
    """Settings an --init draft fixes unless given: its mask token and window."""
    if a.mask_token_id is None:
        a = replace(a, mask_token_id=src.mask_token_id)
    if a.context_window is None and src.sliding_window and all(map(src.is_sliding, range(src.num_hidden_layers))):
        a = replace(a, context_window=src.sliding_window)
    return a


def _check_init(have: DFlashConfig, want: DFlashConfig, path: str) -> None:
    fields = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
              "num_key_value_heads", "head_dim")
    bad = [f for f in fields if getattr(have, f) != getattr(want, f)]
    if len(have.target_layer_ids) != len(want.target_layer_ids):
        bad.append("number of target layers")
    if bad:
        raise TrainError(f"--init draft '{path}' differs from the draft being trained in "
                         f"{', '.join(bad)}; match it with --depth / --target-layer-ids.")


def _save(draft, opt, out: Path, step: int, scale: mx.array) -> None:
    """The folder becomes a loadable draft (fc folded back to raw features);
    exact float32 weights, optimizer state and step go to side files for --resume."""
    w = draft.fc.weight
    draft.fc.weight = w / scale[None]
    try:
        save_draft(draft, str(out))
        arrays = {f"w.{k}": v for k, v in tree_flatten(draft.parameters())}
    finally:
        draft.fc.weight = w
    arrays.update({f"o.{k}": v for k, v in tree_flatten(opt.state)})
    # Not *.safetensors: load_draft reads every such file as draft weights.
    tmp = out / f".{STATE}.tmp.npz"
    mx.savez(str(tmp), **arrays)
    tmp.rename(out / f"{STATE}.npz")
    (out / f"{STATE}.json").write_text(json.dumps({"step": step}) + "\n")


def _weights(arrays: Dict) -> Dict[str, mx.array]:
    return {k[2:]: v for k, v in arrays.items() if k.startswith("w.")}


def float32_weights(folder: Path) -> Optional[Dict[str, mx.array]]:
    """The exact float32 weights of a draft trained here (from the side file
    kept for --resume), or None for a folder without one."""
    f = folder / f"{STATE}.npz"
    return _weights(mx.load(str(f))) if f.exists() else None


def export_draft(src: Path, dest: Path) -> float:
    """Write the draft trained in ``src`` to ``dest`` as config.json and
    float16 weights (rounded from its exact float32 ones when kept), nothing
    else; a failure leaves ``dest`` as it was. Returns the MB written."""
    import shutil

    w = float32_weights(src)
    if w is None:
        w = mx.load(str(src / "model.safetensors"))
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copy2(src / "config.json", tmp / "config.json")
    mx.save_safetensors(str(tmp / "model.safetensors"), {k: v.astype(mx.float16) for k, v in w.items()},
                        metadata={"format": "mlx"})
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return sum(f.stat().st_size for f in dest.iterdir()) / 1e6


def _load_state(draft, opt, out: Path) -> int:
    try:
        step = json.loads((out / f"{STATE}.json").read_text())["step"]
        arrays = mx.load(str(out / f"{STATE}.npz"))
    except (FileNotFoundError, ValueError, KeyError):
        raise TrainError(f"Nothing to resume in '{out}' (no {STATE}.json / .npz).") from None
    draft.update(tree_unflatten(list(_weights(arrays).items())))
    o = dict(tree_flatten(opt.state))
    o.update({k[2:]: v for k, v in arrays.items() if k.startswith("o.")})
    opt.state = tree_unflatten(list(o.items()))
    return int(step)


def evaluate(model, draft, tokenizer, prompts: List[str], block_size: int, max_tokens: int = 128):
    """Mean acceptance length (tau) of greedy DFlash decoding over ``prompts``."""
    from ..engine.decoding import stream_generate

    rounds = committed = 0
    for p in prompts:
        last = None
        for last in stream_generate(model, draft, tokenizer, p, block_size=block_size, max_tokens=max_tokens):
            pass
        if last is not None:
            rounds += last.rounds
            committed += last.committed
    return committed / max(rounds, 1)


def _validate(model, tokenizer, a: TrainArgs) -> None:
    """Refuse options that do not fit the target before any long work."""
    src = load_draft(a.init).config if a.init else None
    if src is not None:
        a = _inherit(a, src)
    cfg = draft_config(model, tokenizer, a)
    if src is not None:
        _check_init(src, cfg, a.init)


def _regenerated(model, tokenizer, records, args) -> List[Sequence]:
    """The target's answers to the data's prompts. Answers already in the
    output folder (from an earlier, perhaps failed, run) are reused; new ones
    are appended there as they finish, so an interrupted run loses none."""
    plen = max(1, args.seq_len // 4)
    prompts = regen_prompts(tokenizer, records, args.seq_len, plen)
    if not prompts:
        raise DataError(f"No prompts to regenerate from in '{args.data}'.")
    cached = Path(args.out) / REGEN
    have = {}
    if cached.exists():
        text = cached.read_text()
        if not text.endswith("\n"):  # drop a last line cut short, or answers appended would join it
            text = text[: text.rfind("\n") + 1]
            cached.write_text(text)
        for line in text.splitlines():
            try:
                q = Sequence(**json.loads(line))
            except (ValueError, TypeError):
                continue  # an unreadable line
            have[tuple(q.tokens[: q.start])] = q
    distinct = {tuple(p): p for p in prompts}
    todo = [p for k, p in distinct.items() if k not in have]
    if have:
        print(f"reusing {len(distinct) - len(todo)} regenerated sequences from {cached}", file=sys.stderr)
    if todo:
        cached.parent.mkdir(parents=True, exist_ok=True)
        n_new = args.regen_tokens or max(1, args.seq_len - plen)
        bar = Progress(len(todo), "regenerate")
        tic = time.perf_counter()
        with open(cached, "a") as f:

            def keep(i, q):
                have[tuple(todo[i])] = q
                f.write(json.dumps(asdict(q)) + "\n")
                f.flush()

            regenerate(model, todo, n_new, set(tokenizer.eos_token_ids), args.regen_batch,
                       lambda done, toks: bar.update(done, toks), keep)
        bar.close()
        print(f"regenerated {len(todo)} sequences in {time.perf_counter() - tic:.0f} s", file=sys.stderr)
    return [have[tuple(p)] for p in prompts]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dflash_mlx.train",
        description="Train a DFlash draft for an mlx-lm target (the target stays frozen).",
    )
    p.add_argument("--model", required=True, help="Target model folder or hub id.")
    p.add_argument("--data", required=True, help="Text file/folder, or JSONL with text, prompt/completion or messages.")
    p.add_argument("--out", required=True, help="Output folder (a z-lab-format draft).")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--depth", "--draft-layers", dest="depth", type=int, default=5, help="Draft layers.")
    p.add_argument("--target-layer-ids", type=str, default=None, help="Comma-separated (default: the DFlash formula).")
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--anchors", type=int, default=32, help="Anchor blocks per sequence.")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--minutes", type=float, default=None, help="Set --steps to fit this training time.")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--gamma", type=float, default=None, help="Loss decay over offsets (default: by block size).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--decode-anchors", action="store_true",
                   help="Move each random anchor to where decoding would start the next block "
                        "(one extra forward pass per step).")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="Propose from the K most frequent target tokens of the data only: a "
                        "K-row LM head makes training and drafting cheaper (0: the whole vocabulary).")
    p.add_argument("--context-window", type=int, default=None,
                   help="The draft attends to at most this many past positions (a sliding window in its "
                        "config): past --seq-len it never sees farther back than it was trained to.")
    p.add_argument("--target-init", action="store_true",
                   help="Start each draft layer as a copy of one of the target's last layers.")
    p.add_argument("--labels", choices=("target", "text"), default="target",
                   help="target: the target's own greedy tokens from the features' forward pass, exact up to "
                        "where the text leaves them (any text is data); text: the text's next tokens.")
    p.add_argument("--data-workers", type=int, default=1,
                   help="Processes (one thread each) computing the kept features and labels (e.g. one per core).")
    p.add_argument("--no-feature-cache", action="store_true",
                   help="Recompute target features every step instead of once (saves disk).")
    p.add_argument("--regenerate", action="store_true", help="Train on the target's own greedy continuations.")
    p.add_argument("--regen-tokens", type=int, default=None, help="Tokens generated per prompt (default: fill --seq-len).")
    p.add_argument("--regen-batch", type=int, default=32)
    p.add_argument("--prepare-only", action="store_true",
                   help="Make the training data (answers, features and labels, kept in --out) and stop.")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--init", default=None, help="Start from this draft's weights (folder or hub id): fine-tuning.")
    p.add_argument("--checkpoint-every", type=int, default=500)
    p.add_argument("--eval-prompts", type=int, default=8, help="Held-out records for the final tau (0: skip).")
    p.add_argument("--eval-data", default=None, help="Evaluate on these records instead (e.g. prompts.jsonl).")
    p.add_argument("--eval-tokens", type=int, default=128)
    return p


def main(argv=None) -> int:
    """Command-line entry point; returns the exit code."""
    args = build_parser().parse_args(argv)
    return run_command(lambda: _run(args))


def _run(args) -> int:
    from .data import prompt_text

    ids = None
    if args.target_layer_ids:
        try:
            ids = [int(x) for x in args.target_layer_ids.split(",")]
        except ValueError:
            raise TrainError("--target-layer-ids must be comma-separated integers.") from None
    for name in ("block_size", "depth", "seq_len", "anchors", "batch_size", "regen_batch", "data_workers"):
        if getattr(args, name) < 1:
            raise TrainError(f"--{name.replace('_', '-')} must be positive.")
    if args.context_window is not None and args.context_window < 1:
        raise TrainError("--context-window must be positive.")
    if args.draft_vocab < 0:
        raise TrainError("--draft-vocab must be positive (or 0: the whole vocabulary).")
    a = TrainArgs(
        block_size=args.block_size, depth=args.depth, target_layer_ids=ids,
        mask_token_id=args.mask_token_id, seq_len=args.seq_len, anchors=args.anchors,
        batch_size=args.batch_size, steps=args.steps, epochs=args.epochs, minutes=args.minutes, lr=args.lr,
        gamma=args.gamma, seed=args.seed, checkpoint_every=args.checkpoint_every, init=args.init,
        decode_anchors=args.decode_anchors, draft_vocab=args.draft_vocab,
        cache_features=not args.no_feature_cache, target_init=args.target_init,
        context_window=args.context_window, labels=args.labels, data_workers=args.data_workers,
    )
    records = read_records(args.data)
    model, tokenizer = load(args.model)
    if args.eval_data:
        held = read_records(args.eval_data)[: args.eval_prompts or None]
    else:
        n = min(args.eval_prompts, len(records) // 10)
        held, records = records[len(records) - n :] if n else [], records[: len(records) - n]
    _validate(model, tokenizer, a)
    if args.regenerate:
        seqs = _regenerated(model, tokenizer, records, args)
    else:
        seqs = sequences(tokenizer, records, args.seq_len)
    if args.prepare_only:
        if a.cache_features:
            train(model, tokenizer, seqs, args.out, a, model_path=args.model, features_only=True)
        print(f"{len(seqs)} training sequences ready", file=sys.stderr)
        return 0
    tic = time.perf_counter()
    train(model, tokenizer, seqs, args.out, a, resume=args.resume, model_path=args.model)
    print(f"trained in {(time.perf_counter() - tic) / 60:.1f} min; draft saved to {args.out}", file=sys.stderr)
    if held and args.eval_prompts:
        draft = load_draft(args.out)
        prompts = [
            tokenizer.decode(tokenizer.encode(r["text"], add_special_tokens=False)[: max(1, a.seq_len // 4)])
            if "prompt" not in r and "messages" not in r else prompt_text(tokenizer, r)
            for r in held
        ]
        tau = evaluate(model, draft, tokenizer, prompts, a.block_size, args.eval_tokens)
        print(f"tau (mean acceptance length, block {a.block_size}, greedy) on {len(prompts)} "
              f"held-out prompts: {tau:.2f}")
    return 0
