"""The target adapter: find the layers, embedding and head of an mlx-lm model,
and capture hidden states at chosen layers for one forward pass.

Capture works by swapping entries of this model instance's layer list (and, for
gated-DeltaNet layers, two of their submodules) for thin recording wrappers,
and by handing the model stand-ins for caches that must be replayed, only for
the duration of one forward call; everything is put back. Nothing is changed
on mlx-lm classes, so other models in the process are never affected.
"""

import threading
import weakref
from contextlib import contextmanager
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from ..errors import UnsupportedModelError
from .rollback import CacheTape, DeltaTape, check_rollback, trims_exactly


def _wrapped(wrapper, name: str):
    """What ``wrapper`` stands in for, from its own attribute ``name``. Read
    from ``__dict__``: a copy made without ``__init__`` (copy.copy, pickle)
    would otherwise recurse through ``__getattr__``."""
    try:
        return wrapper.__dict__[name]
    except KeyError:
        raise AttributeError(name) from None


class _Tap:
    """Calls ``module`` and keeps its first input or its output. A plain
    object, not an nn.Module: its attributes then cost a plain lookup (an
    nn.Module's cost ~20 us a toy forward, ~1% of a plain step)."""

    def __init__(self, module: nn.Module, keep: str):
        self.module = module
        self.keep = keep
        self.value = None

    def __getattr__(self, key):
        # Models read flags off their layers (is_linear, use_sliding, ...).
        return getattr(_wrapped(self, "module"), key)

    def __call__(self, x, *args, **kwargs):
        out = self.module(x, *args, **kwargs)
        # Gemma 4's layers return (hidden, shared_kv, offset).
        self.value = x if self.keep == "input" else out[0] if isinstance(out, tuple) else out
        return out


class _Stop(Exception):
    pass


class _Entry(_Tap):
    """Stands in for the first decoder layer: keeps its input, stops the forward."""

    def __init__(self, module: nn.Module):
        super().__init__(module, "input")

    def __call__(self, x, *args, **kwargs):
        self.value = x
        raise _Stop


class _LayerInput:
    """The draft's embedding when the target transforms its embedding before
    its first layer: that layer's input, computed by the target itself (exact
    whatever the transform). Reads as the embedding module otherwise
    (``weight``, ``parameters()``)."""

    def __init__(self, target: "Target"):
        self._target = target

    def __getattr__(self, key):
        return getattr(_wrapped(self, "_target").embed_tokens, key)

    def __call__(self, tokens: mx.array) -> mx.array:
        return self._target.first_layer_input(tokens)


_outside: Dict[int, bool] = {}


def _embeds_outside(target: "Target") -> bool:
    """Whether the first decoder layer receives something other than
    embed_tokens' output (probed once per model instance), as a function of
    the token alone (learned position embeddings would not be). A pipeline
    keeps the plain embedding: there only one rank sees layer 0's input, and
    every rank must propose the same tokens."""
    key = id(target.model)
    if key not in _outside:
        outside = False
        a, b = target.vocab_rows // 2, target.vocab_rows // 3
        ids = mx.array([[a, b, a, b]])
        try:
            x = None if target.pipeline else target.first_layer_input(ids)
        except Exception:  # a decoder stack that cannot run alone: keep the plain embedding
            x = None
        if x is not None:
            e = target.embed_tokens(ids)
            outside = (
                x.shape == e.shape
                and not (x.dtype == e.dtype and mx.array_equal(x, e).item())
                and mx.array_equal(x[:, :2], x[:, 2:]).item()
            )
        _outside[key] = outside
        weakref.finalize(target.model, _outside.pop, key, None)
    return _outside[key]


def _softcapped(head, cap: Optional[float]):
    """``head`` followed by mlx-lm's final logit softcapping, if the model has one."""
    if not cap:
        return head
    return lambda h: mx.tanh(head(h) / cap) * cap


_locks: Dict[int, threading.RLock] = {}
_locks_guard = threading.Lock()


def _lock_for(model: nn.Module) -> threading.RLock:
    """One lock per model instance: forwards that install taps never overlap."""
    with _locks_guard:
        key = id(model)
        if key not in _locks:
            _locks[key] = threading.RLock()
            weakref.finalize(model, _locks.pop, key, None)
        return _locks[key]


class Target:
    """An mlx-lm model seen as a DFlash target."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.inner, outer = _find_inner(model)
        self.layers: List[nn.Module] = self.inner.layers
        self.embed_tokens = self.inner.embed_tokens
        lm_head = _lm_head(outer)
        self._head_rows = lm_head if lm_head is not None else self.embed_tokens
        self.lock = _lock_for(model)
        # A pipeline-sharded target (mlx-lm's PipelineMixin) runs only layers
        # start..end-1 here; the other entries are None or cut off.
        self.start = getattr(self.inner, "start_idx", 0) or 0
        self.end = getattr(self.inner, "end_idx", None) or len(self.layers)
        self.pipeline = getattr(self.inner, "pipeline_size", 1) > 1
        # Made once: three new modules per forward cost ~80 us, ~2% of a toy step.
        self._tapped: Dict[int, _Tap] = {}
        # The draft reads the target's embedding and head as the target's own
        # layers and logits use them (published drafts were trained so): some
        # models (the Gemmas, Granite, MiniCPM, ...) scale or normalize the
        # embedding between embed_tokens and the first layer, and some cap
        # their logits after the head (final_logit_softcapping).
        self.embed = _LayerInput(self) if _embeds_outside(self) else self.embed_tokens
        head = lm_head if lm_head is not None else self.embed_tokens.as_linear
        self.softcap = model_args(model).get("final_logit_softcapping")
        self.head = _softcapped(head, self.softcap)

    def _tap(self, i: int) -> "_Tap":
        """The recording wrapper of layer ``i``, made once per layer."""
        tap = self._tapped.get(i)
        if tap is None or tap.module is not self.layers[i]:
            tap = self._tapped[i] = _Tap(self.layers[i], "output")
        return tap

    @property
    def num_layers(self) -> int:
        if self.pipeline:
            return model_args(self.model)["num_hidden_layers"]
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self.embed_tokens.weight.shape[1] * _pack_factor(self.embed_tokens)

    @property
    def vocab_rows(self) -> int:
        return self.embed_tokens.weight.shape[0]

    def head_over(self, ids: mx.array):
        """The LM head restricted to the vocabulary rows ``ids``: a function
        from hidden states [..., H] to logits [..., len(ids)]."""
        m = self._head_rows
        w = m.weight[ids]
        bias = getattr(m, "bias", None) if m is not self.embed_tokens else None
        bias = bias[ids] if bias is not None else None  # e.g. phi's lm_head, also quantized
        if not hasattr(m, "scales"):
            rows = lambda h: h @ w.T
        else:
            scales = m.scales[ids]
            biases = m.biases[ids] if getattr(m, "biases", None) is not None else None
            mode = getattr(m, "mode", "affine")
            rows = lambda h: mx.quantized_matmul(
                h, w, scales, biases, transpose=True, group_size=m.group_size, bits=m.bits, mode=mode
            )
        biased = rows if bias is None else (lambda h: rows(h) + bias)
        return _softcapped(biased, self.softcap)

    def first_layer_input(self, tokens: mx.array) -> mx.array:
        """What the first decoder layer receives for ``tokens`` [L] or [B, L]
        (no cache): the forward stops there, so only the embedding stage runs."""
        batch = tokens if tokens.ndim == 2 else tokens[None]
        entry = _Entry(self.layers[0])
        with self.lock:
            self.layers[0] = entry
            try:
                self.inner(batch, cache=None)
            except _Stop:
                pass
            finally:
                self.layers[0] = entry.module
        return entry.value if tokens.ndim == 2 else entry.value[0]

    def make_cache(self) -> list:
        return make_prompt_cache(self.model)

    def check_rollback(self, cache: list) -> None:
        """Raise UnsupportedModelError unless every cache can be rolled back."""
        check_rollback(cache)
        for layer, c in zip(self.layers[self.start : self.end], cache):
            if isinstance(c, ArraysCache):
                _gated_delta(layer)

    def forward(
        self,
        tokens: mx.array,
        cache: list,
        layer_ids: List[int],
        record: bool = False,
    ) -> Tuple[mx.array, mx.array, Optional[List]]:
        """Run the target on ``tokens`` [L] and return its logits [L, V], the
        concatenated outputs of ``layer_ids`` [1, L, n*H], and with ``record``
        what :mod:`rollback` needs to replay the recurrent layers. A batch
        ``tokens`` [B, L] (batched caches) gives logits [B, L, V] and features
        [B, L, n*H]."""
        batch = tokens if tokens.ndim == 2 else tokens[None]
        if not layer_ids and not record:  # nothing to tap: the context costs ~1% of a toy step
            with self.lock:
                logits = self.model(batch, cache=cache)
            return (logits if tokens.ndim == 2 else logits[0]), None, None
        with self.lock:
            if record:
                with self._taps(layer_ids, cache) as (taps, tape, run_cache):
                    logits = self.model(batch, cache=run_cache)
                    features = self._collect(taps, layer_ids, batch, logits)
            else:  # a plain step's path, without a context manager: ~1% of a toy step
                taps, tape = self._tap_layers(layer_ids), None
                try:
                    logits = self.model(batch, cache=cache)
                    features = self._collect(taps, layer_ids, batch, logits)
                finally:
                    self._untap(taps)
        return (logits if tokens.ndim == 2 else logits[0]), features, tape

    def hidden(self, tokens: mx.array, layer_ids: List[int]) -> Tuple[mx.array, mx.array]:
        """Run the target without a cache on a batch ``tokens`` [B, S] and return
        its logits [B, S, V] and the concatenated outputs of ``layer_ids``
        [B, S, n*H] (used to train drafts)."""
        with self.lock, self._taps(layer_ids, None) as (taps, _, _):
            logits = self.model(tokens)
            return logits, self._collect(taps, layer_ids, tokens, logits)

    def features(self, tokens: mx.array, layer_ids: List[int]) -> mx.array:
        """The concatenated outputs of ``layer_ids`` [B, S, n*H] for a batch
        ``tokens`` [B, S], without running the LM head."""
        with self.lock, self._taps(layer_ids, None) as (taps, _, _):
            h = self.inner(tokens)
            return self._collect(taps, layer_ids, tokens, h)

    def _collect(self, taps, layer_ids, tokens, out) -> Optional[mx.array]:
        """The tapped outputs, concatenated. On a pipeline each rank holds only
        its own layers' outputs: the others are zeros here, and one sum over
        the ranks completes them (exactly: x + 0 = x). Ranks must run their
        collectives in one order, so the sum waits for the forward's ``out``
        and runs now, before anything lazy could reorder it."""
        if not layer_ids:
            return None
        if not self.pipeline:
            return mx.concatenate([taps[i].value for i in layer_ids], axis=-1)
        from ..models.distributed import sum_ranks

        shape = (*tokens.shape, self.hidden_size)
        dtype = next((t.value.dtype for t in taps.values()), mx.float32)
        parts = [taps[i].value if i in taps else mx.zeros(shape, dtype) for i in layer_ids]
        return sum_ranks(mx.depends(mx.concatenate(parts, axis=-1), out), "a pipelined forward")

    def _tap_layers(self, layer_ids) -> Dict[int, _Tap]:
        """Put the recording wrappers of ``layer_ids`` (this rank's) in place."""
        taps = {i: self._tap(i) for i in layer_ids if self.start <= i < self.end}
        for i, tap in taps.items():
            self.layers[i] = tap
        return taps

    def _untap(self, taps: Dict[int, _Tap]) -> None:
        """Put the layers back, dropping what the wrappers kept."""
        for i, tap in taps.items():
            self.layers[i], tap.value = tap.module, None

    @contextmanager
    def _taps(self, layer_ids, cache):
        """Tap the outputs of ``layer_ids``; with ``cache``, also record what
        rollback needs: gated-DeltaNet inputs, and the updates of caches that
        cannot simply be trimmed (these run through stand-ins)."""
        taps: Dict[int, _Tap] = {}
        deltas: List[Tuple[nn.Module, nn.Module, _Tap, _Tap]] = []
        tape, run_cache = [], None
        try:
            taps = self._tap_layers(layer_ids)
            if cache is not None:
                run_cache = list(cache)
                for j, c in enumerate(cache):  # caches of this rank's layers
                    if isinstance(c, ArraysCache):
                        layer = self.layers[self.start + j]
                        layer = layer.module if isinstance(layer, _Tap) else layer
                        gdn = _gated_delta(layer)
                        inp, conv = _Tap(gdn, "input"), _Tap(gdn.conv1d, "input")
                        deltas.append((layer, gdn, inp, conv))
                        gdn.conv1d, layer.linear_attn = conv, inp
                        tape.append(DeltaTape(c, list(c.cache), gdn, inp, conv))
                    elif not trims_exactly(c):
                        run_cache[j] = _CacheTap(c)
                        tape.append(CacheTape(c, c.state, run_cache[j]))
            yield taps, tape, run_cache
        finally:
            self._untap(taps)
            for layer, gdn, _, conv in deltas:
                layer.linear_attn = gdn
                gdn.conv1d = conv.module


class _CacheTap:
    """Stands in for a cache during one forward pass and keeps its update."""

    def __init__(self, cache):
        self.cache = cache
        self.value = None

    def __getattr__(self, key):
        return getattr(_wrapped(self, "cache"), key)

    def update_and_fetch(self, keys, values):
        self.value = (keys, values)
        return self.cache.update_and_fetch(keys, values)


def model_args(model: nn.Module) -> Dict:
    """The text model's config as a dict (``args``, or its ``text_config``)."""
    for m in (model, getattr(model, "language_model", None)):
        a = getattr(m, "args", None)
        if a is not None:
            a = getattr(a, "text_config", None) or a
            return a if isinstance(a, dict) else vars(a)
    return {}


def _gated_delta(layer: nn.Module) -> nn.Module:
    gdn = getattr(layer, "linear_attn", None)
    if gdn is None or not hasattr(gdn, "conv1d") or not hasattr(gdn, "A_log"):
        raise UnsupportedModelError(
            f"{type(layer).__module__}: this target has recurrent layers that are not "
            "gated-DeltaNet (Qwen3.5/Qwen3-Next style); dflash_mlx cannot roll them "
            "back exactly. Use block_size=1 or a supported target."
        )
    return gdn


def _find_inner(model: nn.Module):
    """The decoder stack (with .layers and .embed_tokens) and its owner."""
    outer = model
    for _ in range(3):
        inner = getattr(outer, "model", None)
        if inner is not None and hasattr(inner, "layers") and hasattr(
            inner, "embed_tokens"
        ):
            return inner, outer
        nxt = getattr(outer, "language_model", None)
        if nxt is None:
            break
        outer = nxt
    raise UnsupportedModelError(
        f"Cannot find the decoder layers of {type(model).__module__}.{type(model).__name__}: "
        "dflash_mlx expects layers and embed_tokens under model.model, "
        "or language_model.model, as mlx-lm text models have."
    )


def _lm_head(outer: nn.Module) -> Optional[nn.Module]:
    """The untied LM head, also where it sits beside the decoder one level
    down (Kimi-K2.5: model.language_model.lm_head, model.model a property)."""
    for m in (outer, getattr(outer, "language_model", None)):
        head = getattr(m, "lm_head", None)
        if head is not None:
            return head
    return None


def _pack_factor(embed: nn.Module) -> int:
    bits = getattr(embed, "bits", None)
    return 32 // bits if bits else 1
