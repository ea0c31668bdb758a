"""Batched DFlash: several generations share every target forward.

Each row keeps what a single generation has (its draft cache and draft pass,
its policy, sampler and acceptance: the code of :mod:`.decoding`); only the
target runs batched, over one block per row padded to the longest, on mlx-lm
``BatchKVCache`` caches where each row is rolled back by its own amount
(:func:`.rollback.rollback_rows`). Rows join and leave between rounds. Every
row's output is the one it would get alone. Targets whose caches all trim
exactly (plain attention: Llama, Qwen3, ...) only, in one process.
"""

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .checks import check_args, check_vocab, prompt_ids
from .decoding import DraftCache, GenerationResponse, _Decoder, _drawing, _response, _take
from ..models.distributed import group
from .draft import DFlashDraft
from ..errors import GenerationArgumentError, UnsupportedModelError
from ..models.loading import check_compatible
from . import policy as _policy
from .policy import Policy
from .rollback import rollback_rows, trims_exactly
from .target import Target


@dataclass
class _Row:
    dec: _Decoder
    ids: List[int]  # the prompt (this request's tokens)
    history: List[int]
    max_tokens: int
    out: List[int]  # the first token(s), not reported yet
    detok: object
    prompt_tps: float
    cache: Optional[list]  # the caller's prompt cache, refilled when the row leaves
    sampled: bool = False
    n: int = 0
    tic: float = field(default_factory=time.perf_counter)


class Batch:
    """Generations decoded together.

    Args:
        model: The target (an mlx-lm model whose caches trim exactly).
        draft: Its DFlash draft, or None (batched plain decoding).
        tokenizer: The target's tokenizer.
        block_size: As for :func:`.stream_generate` (``"auto"``: one length
            for all rows each round, chosen by the tokens per second each
            length has made at this many rows).
    """

    def __init__(self, model: nn.Module, draft: Optional[DFlashDraft], tokenizer,
                 block_size: Union[int, str, None] = None):
        if group() is not None:
            raise GenerationArgumentError("Batched generation runs in one process, not under mlx.launch.")
        self.bs = check_args(draft, block_size, 1, 0.0, 0.0, 0, 0.0, None)
        if draft is not None:
            check_compatible(draft, model)
        self.target = Target(model)
        if not all(trims_exactly(c) for c in self.target.make_cache()):
            raise UnsupportedModelError(
                f"{type(model).__module__}: batched generation needs plain attention caches; "
                "generate these requests one at a time."
            )
        self.top = draft.block_size if self.bs == "auto" else self.bs
        self.draft = draft if self.top > 1 else None
        self.tokenizer = tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)
        self.auto = self.bs == "auto" and self.draft is not None
        self.rows: Dict[int, _Row] = {}
        # The rows' batched caches (in self.rows' order); None while one row
        # runs alone on its own caches, as stream_generate would.
        self.cache: Optional[List[BatchKVCache]] = None
        self.widest = 0  # the most rows one round has verified together
        self._next = 0
        self._tick, self._last = 0.0, None  # when the last batched round ended, and its (width, drafted)

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, prompt, max_tokens: int = 256, temperature: float = 0.0, top_p: float = 0.0,
            top_k: int = 0, min_p: float = 0.0, seed: Optional[int] = None,
            prompt_cache: Optional[list] = None, draft_cache: Optional[DraftCache] = None,
            prefill_step_size: int = 2048) -> int:
        """Prefill a new row and return its key. ``prompt_cache`` /
        ``draft_cache`` continue earlier turns as in :func:`.stream_generate`;
        the prompt cache is refilled when the row leaves the batch."""
        check_args(self.draft, self.bs, max_tokens, temperature, top_p, top_k, min_p, seed)
        ids = prompt_ids(self.tokenizer, prompt)
        check_vocab(ids, self.target.vocab_rows)
        cache = make_prompt_cache(self.target.model) if prompt_cache is None else prompt_cache
        if not all(trims_exactly(c) for c in cache):
            raise UnsupportedModelError("Batched generation needs plain attention caches (KVCache).")
        sampled = temperature > 0  # which of the draft's two "auto" policies the row uses
        dec = _Decoder(self.target, self.draft, None, list(cache), False, draft_cache,
                       **_drawing(self.target, self.draft, cache, temperature, top_p, min_p, top_k, seed),
                       policy=Policy.of(self.draft, sampled) if self.auto else None)
        tic = time.perf_counter()
        first = dec.prefill(ids, prefill_step_size, more=0 if self.rows else min(self.top, max_tokens - 1))
        mx.eval([c.state for c in dec.cache])
        row = _Row(dec, ids, list(ids), max_tokens, first, self.tokenizer.detokenizer,
                   len(ids) / (time.perf_counter() - tic), prompt_cache, sampled)
        row.detok.reset()
        if self.rows:
            if self.cache is None:  # the first row ran alone: its queued step out, into a batch
                alone = next(iter(self.rows.values())).dec
                alone.settle()
                self.cache = [BatchKVCache.merge([c]) for c in alone.cache]
            for c, o in zip(self.cache, dec.cache):
                c.extend(BatchKVCache.merge([o]))
        self._last = None  # the next round pays for this prefill: not timed
        key, self._next = self._next, self._next + 1
        self.rows[key] = row
        return key

    def remove(self, key: int) -> None:
        """Take row ``key`` out (finished or abandoned); its prompt cache, if
        the caller gave one, then holds the row's tokens but the last."""
        keys = list(self.rows)
        i = keys.index(key)
        row = self.rows.pop(key)
        if self.cache is None:  # it ran alone, on its own caches
            row.dec.settle()
            own = row.dec.cache
        else:
            own = [c.extract(i) for c in self.cache] if row.cache is not None else None
            if len(self.rows) == 1:  # the last one goes on alone
                alone = self.rows[keys[1 - i]].dec
                alone.cache = [c.extract(1 - i) for c in self.cache]
                alone.timer.start()  # timed afresh
                self.cache = None
            else:
                for c in self.cache:
                    c.filter([k for k in range(len(keys)) if k != i])
        if row.cache is not None:
            row.cache[:] = own
            # Evaluated here: MLX cannot evaluate this thread's lazy arrays on another.
            arrays = [c.state for c in row.cache]
            if self.draft is not None:
                d = row.dec.dstate
                arrays += [c.state for c in d.cache if c.keys is not None] + [d.pending]
            mx.eval(arrays)
        row.dec.remember(self.draft)

    def clear(self) -> None:
        """Drop every row at once (their prompt caches are left unfilled)."""
        self.rows.clear()
        self.cache = None

    def step(self) -> List[Tuple[int, GenerationResponse]]:
        """One round for every row: (key, response) pairs of the new tokens (a
        row added since the last step reports its first token too). A
        finished row (``finish_reason`` set) has left the batch."""
        out = []
        for key in [k for k, r in self.rows.items() if r.out]:
            out.append((key, self._report(key)))
        if self.rows:
            self._round()
            out += [(key, self._report(key)) for key in list(self.rows)]
        return out

    def _round(self) -> None:
        rows = list(self.rows.values())
        self.widest = max(self.widest, len(rows))
        if self.cache is None:  # one row: the single-sequence round, plain steps pipelined
            row = rows[0]
            left = row.max_tokens - row.n
            row.out = row.dec.round(row.history, min(self.top, left), more=min(self.top, left - 1))
            return
        anchors = [mx.array(r.history[-1:]) for r in rows]
        limits = [min(self.top, r.max_tokens - r.n) for r in rows]
        most = max(limits) if self.draft is not None else 1
        policy = self.policy
        length = policy.choose(most, len(rows), all(r.dec.ready for r in rows)) if policy is not None else most
        lengths = [min(length, n) for n in limits]
        blocks, props = [], []
        for r, a, n in zip(rows, anchors, lengths):
            p, q = r.dec.propose(a, n, len(r.history)) if n > 1 else (None, None)
            blocks.append(a if p is None else mx.concatenate([a, p]))
            props.append((p, q))
        L = max(b.shape[0] for b in blocks)
        # Shorter rows are padded with their anchor; rolled back with the rejected drafts.
        tokens = mx.stack([mx.concatenate([b, mx.repeat(b[:1], L - b.shape[0])]) for b in blocks])
        logits, f, _ = self.target.forward(tokens, self.cache, self.target_layers)
        kept = []
        for i, row in enumerate(rows):
            p, q = props[i]
            n = blocks[i].shape[0]
            kept.append(row.dec._choose(logits[i, :n], row.history, blocks[i], p, q=q))
        rollback_rows(self.cache, [L - a - 1 for _, a in kept])
        # A row near its end verified fewer: what it accepted says nothing of depths beyond.
        self._learn(policy, length, [a for (_, a), n in zip(kept, lengths) if n == length > 1], len(rows))
        for i, row in enumerate(rows):
            choice, a = kept[i]
            feats = f[i : i + 1] if f is not None else None
            row.out = row.dec.commit(choice, a, feats, blocks[i].shape[0])

    @property
    def policy(self) -> Optional[Policy]:
        """What chooses a round's length under "auto": the sampled generations'
        policy if a row samples, else the greedy ones'."""
        return Policy.of(self.draft, any(r.sampled for r in self.rows.values())) if self.auto else None

    def _learn(self, policy: Optional[Policy], length: int, accepted: List[int], width: int) -> None:
        """Teach the policy a batched round (timed as :class:`.RoundTimer` times one row's,
        but only the first round after a switch is left untimed: in batches of 4 rows the
        second ran no slower than the next ones, docs/measurements.md, session 47)."""
        now, kind = _policy.clock(), (width, length > 1)
        if policy is not None:
            if accepted:
                policy.learn(length, accepted)
            if self._last is not None:
                if kind == self._last:  # not a switch
                    policy.time(length, now - self._tick, width)
                policy.spend(now - self._tick, 1 + sum(accepted) / len(accepted) if accepted else 1, width,
                                  drafted=length > 1)
            policy.took(length, width)
        self._tick, self._last = now, kind

    @property
    def target_layers(self) -> List[int]:
        return self.draft.config.target_layer_ids if self.draft is not None else []

    def _report(self, key: int) -> GenerationResponse:
        """Book row ``key``'s new tokens; it leaves the batch if they finish it."""
        row = self.rows[key]
        tokens = row.out
        new, row.n, finish = _take(tokens, row.n, row.max_tokens, set(self.tokenizer.eos_token_ids), row.detok)
        if finish:
            self.remove(key)
        row.history.extend(new)
        row.out = []
        return _response(row.dec, tokens, new, row.detok.last_segment, row.n, finish, len(row.ids),
                         row.prompt_tps, row.tic)


def batch_generate(model: nn.Module, draft: Optional[DFlashDraft], tokenizer, prompts: List,
                   max_tokens: int = 256, block_size: Union[int, str, None] = None,
                   **sampling) -> List[List[int]]:
    """Generate for several prompts at once; the token ids of each (a final
    EOS included), each exactly what :func:`.stream_generate` gives alone."""
    batch = Batch(model, draft, tokenizer, block_size)
    keys = [batch.add(p, max_tokens, **sampling) for p in prompts]
    outs: Dict[int, List[int]] = {k: [] for k in keys}
    while len(batch):
        for key, r in batch.step():
            outs[key] += r.tokens
    return [outs[k] for k in keys]
