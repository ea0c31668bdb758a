"""DFlash speculative generation: the decoding loop and its responses."""

import random
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Generator, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..models.distributed import agree, group
from .checks import check_args, check_variants, check_vocab, prompt_ids
from .draft import DFlashDraft
from ..errors import GenerationArgumentError
from ..models.loading import check_compatible
from .policy import Policy
from .proposal import Tuner
from .rollback import rollback, trims_exactly
from .sampling import (
    Noise,
    Sampler,
    accepted,
    greedy,
    held,
    make_distribution,
    make_draw,
    make_sampler,
    near_top,
    process,
    speculative,
)
from .target import Target
from .timing import RoundTimer

# Plain steps run pipelined where they can (see _Decoder). A modelled clock
# that charges a forward when it is called turns this off: pipelined, a queued
# step would be charged to the round before the one that computes it.
PIPELINE = True
# Plain steps taken while plain steps win and no probe is near record no
# features (on a 2.4 ms toy step the taps cost ~1.7%): the draft's context
# gets a gap there, and drafting waits until the draft has this many
# positions after the last gap.
RECENT = 16


@dataclass
class GenerationResponse:
    """One round of :func:`stream_generate`.

    Args:
        text: The text decoded from this round's tokens (may be empty).
        token: The last token of this round.
        tokens: The token ids committed this round (an EOS that ends the
            generation included, as mlx-lm reports it).
        accepted: Tokens committed this round, bonus included (1..block size).
        verified: Tokens the target verified this round (the anchor and the
            drafts checked; 1 for a plain step, 0 for the prefill's token).
        prompt_tokens, prompt_tps: Prompt length and prefill speed.
        generation_tokens, generation_tps: Tokens generated so far and their
            rate since the first one.
        peak_memory: Peak MLX memory so far, in GB.
        finish_reason: "stop", "length" or None.
        exact: False when ``accept_threshold`` let near-top draft tokens in:
            the output is then not exactly the target's.
        logprobs: The target's log-probabilities [len(tokens), V] of each
            token's position (after logits processors, before temperature
            and filters, as mlx-lm reports them).
    """

    text: str
    token: int
    tokens: List[int]
    accepted: int
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: Optional[str] = None
    rounds: int = 0
    committed: int = 0
    verified: int = 0
    timing: Optional[Dict[str, float]] = None
    logprobs: Optional[mx.array] = field(default=None, repr=False)
    from_draft: bool = False
    exact: bool = True

    @property
    def mean_accepted(self) -> float:
        """Mean tokens committed per decoding round so far (tau); the first
        token, which comes from the prefill, is not a round."""
        return self.committed / self.rounds if self.rounds else 0.0


class DraftCache:
    """The draft's side of a prompt cache: its context K/V cache, the target
    features it has not read yet, and gaps (tokens whose features were never
    taken: plain steps while plain steps win). Pass one with ``prompt_cache``
    to :func:`stream_generate` so a continued conversation keeps the draft's
    context (higher acceptance); it always covers as many tokens as the target
    cache, and must be trimmed with it (:meth:`trim`)."""

    def __init__(self, draft: DFlashDraft):
        self.draft = draft
        self.cache = draft.make_cache()
        self._parts: List[mx.array] = []  # joined once, when read
        # [cache offset, length] of each gap: positions the draft never read
        self.gaps: List[List[int]] = []

    @property
    def pending(self) -> Optional[mx.array]:
        """The queued features [1, L, n*H], or None."""
        if len(self._parts) > 1:
            self._parts = [mx.concatenate(self._parts, axis=1)]
        return self._parts[0] if self._parts else None

    @pending.setter
    def pending(self, features: Optional[mx.array]) -> None:
        self._parts = [] if features is None else [features]

    @property
    def missing(self) -> int:
        """Positions in the gaps (left out of the draft's cache)."""
        return sum(n for _, n in self.gaps)

    @property
    def size(self) -> int:
        """Tokens covered: read into the cache, pending or in a gap."""
        return self.cache[0].offset + self.missing + self._queued

    @property
    def recent(self) -> int:
        """Tokens covered since the last gap (read or pending)."""
        after = self.cache[0].offset - (self.gaps[-1][0] if self.gaps else 0)
        return after + self._queued

    @property
    def _queued(self) -> int:
        return sum(p.shape[1] for p in self._parts)

    def extend(self, features: mx.array) -> None:
        """Queue target features [1, L, n*H] the draft has not read yet."""
        self._parts.append(features)

    def skip(self, n: int) -> None:
        """Cover ``n`` tokens whose features were not taken: a gap in the
        draft's context. The features still pending (the prompt's, say) are
        read first, lazily: computed only if the draft proposes again."""
        if self._parts:
            self.draft.read(self.pending, self.cache, self.missing)
            self._parts = []
        at = self.cache[0].offset
        if self.gaps and self.gaps[-1][0] == at:
            self.gaps[-1][1] += n
        else:
            self.gaps.append([at, n])

    def trim(self, n: int) -> None:
        """Forget the last ``n`` tokens."""
        pending = self.pending
        if pending is not None and n > 0:
            keep = max(pending.shape[1] - n, 0)
            n -= pending.shape[1] - keep
            self.pending = pending[:, :keep] if keep else None
        while n > 0:
            at, gap = self.gaps[-1] if self.gaps else (0, 0)
            read = min(n, self.cache[0].offset - at)
            for c in self.cache:
                c.trim(read)
            n -= read
            if not n or not self.gaps:
                break
            self.gaps[-1][1] -= min(n, gap)
            n -= min(n, gap)
            if not self.gaps[-1][1]:
                self.gaps.pop()


def _take(tokens: List[int], n: int, max_tokens: int, eos: set, detok):
    """A round's tokens committed up to an EOS or ``max_tokens`` (``n``
    generated before them) and detokenized: (new tokens, n, finish reason)."""
    finish, new = None, []
    for t in tokens:
        new.append(t)
        n += 1
        if t in eos:
            finish = "stop"
            break
        detok.add_token(t)
        if n == max_tokens:
            finish = "length"
            break
    if finish:
        detok.finalize()
    return new, n, finish


def _response(dec: "_Decoder", tokens: List[int], new: List[int], text: str, n: int,
              finish: Optional[str], prompt_tokens: int, prompt_tps: float, tic: float) -> GenerationResponse:
    """The response to a round of ``dec`` that committed ``tokens``, ``new``
    of them reported (see :func:`_take`), ``n`` tokens generated since ``tic``."""
    return GenerationResponse(
        text=text,
        token=new[-1],
        tokens=new,
        accepted=len(tokens),
        prompt_tokens=prompt_tokens,
        prompt_tps=prompt_tps,
        generation_tokens=n,
        generation_tps=n / max(time.perf_counter() - tic, 1e-9),
        peak_memory=mx.get_peak_memory() / 1e9,
        finish_reason=finish,
        rounds=dec.rounds,
        committed=dec.committed,
        verified=dec.verified,
        timing=dec.timing,
        from_draft=len(tokens) > 1,
        exact=dec.threshold is None,
        # Sliced only where an EOS or max_tokens cut the round: a slice is an
        # op, and a plain step's costs ~0.5% of a toy target's step.
        logprobs=dec.logprobs if len(new) == dec.logprobs.shape[0] else dec.logprobs[: len(new)],
    )


def stream_generate(
    model: nn.Module,
    draft: Optional[DFlashDraft],
    tokenizer,
    prompt: Union[str, List[int], mx.array],
    block_size: Union[int, str, None] = None,
    max_tokens: int = 256,
    temperature: float = 0.0,
    sampler: Optional[Sampler] = None,
    top_p: float = 0.0,
    top_k: int = 0,
    min_p: float = 0.0,
    logits_processors: Optional[List[Callable]] = None,
    seed: Optional[int] = None,
    prefill_step_size: int = 2048,
    prompt_cache: Optional[list] = None,
    draft_cache: Optional[DraftCache] = None,
    profile: bool = False,
    accept_threshold: Optional[float] = None,
    denoise_steps: int = 1,
    proposal: Optional[str] = None,
) -> Generator[GenerationResponse, None, None]:
    """Generate with DFlash speculative decoding, one response per round.

    The output is exactly the target's own: token-identical to plain greedy
    decoding at temperature 0, and distributed as the target's sampling
    otherwise.

    Args:
        model: The target, an mlx-lm model.
        draft: A DFlash draft made for this target (``None`` decodes plainly).
        tokenizer: The target's tokenizer (mlx-lm ``TokenizerWrapper`` or HF).
        prompt: Text, token ids, or an ``mx.array`` of ids.
        block_size: Tokens verified per round (anchor included): ``"auto"``
            (the default, ``None``) chooses each round's length, from plain
            steps up to the draft's trained block, by the tokens per second
            each length has been making (see :mod:`dflash_mlx.engine.policy`);
            an integer fixes it, 1 being plain decoding. Larger than the
            draft's is refused.
        max_tokens: The most tokens to generate.
        temperature: 0 for greedy; else sampling temperature.
        sampler: A custom sampler over log-probability rows [N, V] -> [N];
            overrides temperature/top_p/top_k/min_p/seed.
        top_p, top_k, min_p: Filters, as in ``mlx_lm.sample_utils``.
        logits_processors: mlx-lm logits processors (e.g. repetition penalty).
        seed: Make sampling reproducible without touching MLX's global RNG:
            a token's draw then depends on the seed and its position only, so
            a seed gives the same text at every block size and without a
            draft (up to the target's rounding, which differs between block
            shapes).
        prefill_step_size: Prompt tokens per prefill forward pass.
        prompt_cache: A target cache from ``mlx_lm.models.cache.make_prompt_cache``
            holding earlier turns; the prompt continues it, and it is updated
            in place (once the generation ends or its generator is closed, it
            holds every token but the last).
        draft_cache: With ``prompt_cache``, the draft's context for the same
            tokens (a :class:`DraftCache`), updated in place; without it the
            draft starts from the new tokens only (lower acceptance, same text).
        profile: Synchronise after each phase and report its time in
            ``response.timing`` (slightly slower; for benchmarks).
        accept_threshold: ``None`` (exact). A float T in (0, 1] also accepts a
            draft token whose target probability is at least T times the top
            one (after temperature and filters; the plain softmax at
            temperature 0 or with a custom sampler): faster, but the output is
            no longer the target's (``response.exact`` is False).
        denoise_steps: Draft passes per round (block-diffusion denoising:
            after each pass the surest guesses stay, the rest is masked again).
            The output stays exact.
        proposal: ``"argmax"`` (the draft's best guesses) or ``"sample"``:
            draft tokens drawn from the draft's distribution (the target's
            filters, at a multiple of its temperature tuned as it goes, see
            :mod:`dflash_mlx.engine.proposal`), verified with the p/q rule or, with a
            ``seed`` (and under mlx.launch), drawn with the noise the target
            draws its token with at the same position. Exact either way.
            ``None`` (default): ``"sample"`` when sampling with
            temperature/filters, ``"argmax"`` with a custom sampler.
    """
    bs = check_args(draft, block_size, max_tokens, temperature, top_p, top_k, min_p, seed)
    check_variants(accept_threshold, denoise_steps, proposal, sampler)
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    ids = prompt_ids(tokenizer, prompt)
    if draft is not None:
        check_compatible(draft, model)
    target = Target(model)
    top = draft.block_size if bs == "auto" else bs
    check_vocab(ids, target.vocab_rows)
    if draft_cache is not None and (prompt_cache is None or top == 1):
        raise GenerationArgumentError(
            "draft_cache goes with a prompt_cache and a draft that drafts (block_size > 1)."
        )
    if sampler is None and temperature > 0 and seed is None and group() is not None:
        seed = agree(mx.array([random.getrandbits(30)])).item()  # every rank draws the same drafts
    drafter = draft if top > 1 else None
    dec = _Decoder(
        target,
        drafter,
        logits_processors,
        prompt_cache,
        profile,
        draft_cache,
        threshold=accept_threshold,
        steps=denoise_steps,
        **_drawing(target, drafter, prompt_cache, temperature, top_p, min_p, top_k, seed, sampler, proposal),
        policy=Policy.of(draft, sampler is None and temperature > 0) if bs == "auto" else None,
    )
    eos = set(tokenizer.eos_token_ids)
    detok = tokenizer.detokenizer
    detok.reset()
    history = list(ids)

    with wired_limit(model, [generation_stream]):
        tic = time.perf_counter()
        # The model's lock covers whole steps, evaluation included: MLX does
        # not make concurrent evaluation of one model's graphs safe.
        with target.lock, mx.stream(generation_stream):
            tokens = dec.prefill(ids, prefill_step_size, more=min(top, max_tokens - 1))
        prompt_tps = len(ids) / (time.perf_counter() - tic)
        tic = time.perf_counter()
        n = 0
        try:
            while True:
                new, n, finish = _take(tokens, n, max_tokens, eos, detok)
                history.extend(new)
                yield _response(dec, tokens, new, detok.last_segment, n, finish, len(ids), prompt_tps, tic)
                if finish:
                    return
                with target.lock, mx.stream(generation_stream):
                    tokens = dec.round(history, min(top, max_tokens - n), more=min(top, max_tokens - n - 1))
        finally:
            # A step queued ahead (plain steps run pipelined) leaves the caches.
            with target.lock, mx.stream(generation_stream):
                dec.settle()
            dec.remember(draft)


def _drawing(target: Target, draft: Optional[DFlashDraft], cache: Optional[list], temperature: float,
            top_p: float, min_p: float, top_k: int, seed: Optional[int], sampler: Optional[Sampler] = None,
            proposal: Optional[str] = None) -> dict:
    """How a generation draws its tokens, as :class:`_Decoder` arguments:
    the sampler (``sampler``, else mlx-lm's for these settings), the
    distribution drafts are verified against, with ``seed`` the
    position-keyed noise and its draw, and for a drafting ``draft`` that
    samples its proposals the tuner of their temperature."""
    sampled = sampler is None and temperature > 0
    noise = Noise(seed, target.vocab_rows, held(cache)) if sampled and seed is not None else None
    tune = sampled and draft is not None and proposal != "argmax"
    return dict(
        sampler=sampler or make_sampler(temperature, top_p, min_p, top_k),
        greedy=sampler is None and temperature == 0,
        dist=make_distribution(0.0 if sampler is not None else temperature, top_p, min_p, top_k),
        draw=make_draw(temperature, top_p, min_p, top_k) if noise is not None else None,
        noise=noise,
        tuner=Tuner(temperature, top_p, min_p, top_k).recall(draft) if tune else None,
    )


class _Decoder:
    """The target, the draft and their caches for one generation."""

    def __init__(
        self, target, draft, processors, cache, profile, dstate=None, sampler=None, greedy=False,
        threshold=None, steps=1, dist=None, draw=None, noise=None, tuner=None, policy=None,
    ):
        self.target, self.draft = target, draft
        self.threshold, self.steps, self.dist = threshold, steps, dist or make_distribution()
        # Seeded sampling draws with position-keyed noise (a sampled draft too,
        # through the tuner); a sampled draft without it is verified with the p/q rule.
        self.draw, self.noise, self.tuner = draw, noise, tuner
        self.sampler, self.processors, self.profile = sampler, processors, profile
        self.greedy, self.fast = greedy, greedy and not processors
        self.cache = cache if cache is not None else target.make_cache()
        self.layer_ids = draft.config.target_layer_ids if draft is not None else []
        if draft is not None:
            target.check_rollback(self.cache)
            self.dstate = dstate if dstate is not None else DraftCache(draft)
            self.dcache = self.dstate.cache
            # A draft with its own (smaller) vocabulary proposes from those rows only.
            vocab = draft.config.draft_vocab
            self.vocab = mx.array(vocab) if vocab else None
            self.head = target.head_over(self.vocab) if vocab else target.head
        self.rounds, self.committed, self.verified, self.timing = 0, 0, 0, None
        # Plain steps run pipelined as mlx-lm's own loop does (the next step is
        # queued on the lazily chosen token before this one is read) where a
        # queued step can be taken back: trimmable caches, one process, and
        # no logits processors (they would need the token on the host).
        self.pipelined = (PIPELINE and not processors and not profile and group() is None
                          and all(trims_exactly(c) for c in self.cache))
        # Gaps need "auto", one process (the ranks would have to agree on
        # each) and a draft whose positions need no window over its context.
        self.skips = policy is not None and self.pipelined and draft is not None and all(
            layer.self_attn.window is None for layer in draft.layers)
        self.ahead = None  # the queued step: (token [1], features, log-probabilities)
        self.logprobs = None  # of the tokens last committed [k, V]
        self._verified = None  # (logits, history, block) of the block last verified
        self._unchecked = None  # (drafts beyond a probe's block, the first one's depth)
        self.timer = RoundTimer(policy)  # teaches the policy that chooses each round's length ("auto")

    @property
    def policy(self) -> Optional[Policy]:
        """The policy choosing each round's length ("auto"), or None: the
        timer's, so that the one chosen with is the one taught."""
        return self.timer.policy

    def prefill(self, ids: List[int], step: int, more: int = 0) -> List[int]:
        """Run the prompt through the target; return its first token. ``more``:
        the first round's limit; if that round is a plain step, it is queued
        before the first token is read, as mlx-lm's loop does."""
        # As mlx-lm's loop: every token but the last in chunks whose logits are
        # never computed, then the last alone (the head over a whole chunk's
        # rows cost ~8% of a 512-token SmolLM2 prefill).
        feats, head = [], ids[:-1]
        for i in range(0, len(head), step):
            _, f, _ = self.target.forward(mx.array(head[i : i + step]), self.cache, self.layer_ids)
            feats += [f] if f is not None else []
            mx.eval([c.state for c in self.cache] + feats)
        last = mx.array(ids[-1:])
        logits, f, _ = self.target.forward(last, self.cache, self.layer_ids)  # [1, V]
        feats += [f] if f is not None else []
        if feats:
            self.dstate.extend(mx.concatenate(feats, axis=1))
        self.logprobs = process(logits, mx.array(head), last, self.processors)
        first = self.pick(logits, self.logprobs, len(ids))
        if more and self.pipelined and self.length(more) == 1:
            self._queue(first, len(ids) + 1)
        first = agree(first).tolist()
        self.timer.start()
        return first

    def rows(self, logits: mx.array, logp: mx.array) -> mx.array:
        """What the target's choice is made from: the log-probabilities
        (after logits processors), or the raw logits for the noise's draw
        without processors (it ignores the log-softmax's shift, and skipping
        it saves an exp per entry; ``logp`` is then never evaluated)."""
        return logits if self.noise is not None and not self.processors else logp

    def pick(self, logits: mx.array, logp: mx.array, pos: int) -> mx.array:
        """The target's tokens for rows [n, V] (see :meth:`rows`) at
        positions pos .. pos + n - 1."""
        x = self.rows(logits, logp)
        if self.noise is None:
            return self.sampler(x)
        return self.draw(x, self.noise(pos, x.shape[0]))

    def length(self, limit: int) -> int:
        """This round's length, at most ``limit`` (1: a plain step)."""
        if self.draft is None or limit <= 1 or self.ahead is not None:
            return 1
        return limit if self.policy is None else self.policy.choose(limit, ready=self.ready)

    @property
    def ready(self) -> bool:
        """Whether the draft has read enough since the last gap in its context."""
        return self.draft is None or not self.dstate.gaps or self.dstate.recent >= RECENT

    def round(self, history: List[int], limit: int, more: int = 0) -> List[int]:
        """Draft up to ``limit - 1`` tokens after the last one (``"auto"``
        chooses how many, maybe none), verify them and return the committed
        tokens (accepted drafts plus the bonus). ``more``: the next round's
        limit if the generation goes on (unless this round ends with an EOS)."""
        length = self.length(limit)
        if length == 1 and self.pipelined:
            return self._plain(history, more)
        anchor = mx.array(history[-1:])
        clock = _Clock(self.profile)
        # A greedy probe drafts twice as far as it verifies: the drafts beyond
        # are checked against the tokens that follow, for free (see _check).
        reach = min(2 * length, limit) if length > 1 and self._deeper() else length
        proposal, q = self.propose(anchor, reach, len(history)) if length > 1 else (None, None)
        if proposal is not None:
            clock.lap("draft", proposal)
            proposal, beyond = proposal[: length - 1], proposal[length - 1 :]
        block = anchor if proposal is None else mx.concatenate([anchor, proposal])
        # A plain step still records features, so the draft's context stays whole.
        logits, f, tape = self.target.forward(block, self.cache, self.layer_ids, self.draft is not None)
        clock.lap("verify", logits)
        out, a = self._choose(logits, history, block, proposal, q=q)
        rollback(self.cache, tape, a + 1, block.shape[0])
        self.timer.learn(length, a)
        out = self.commit(out, a, f, block.shape[0])
        self._check(out)
        if reach > length and a == length - 1:
            self._unchecked = (beyond.tolist(), length - 1)
            self._check(out[-1:])  # the bonus token: the first draft beyond
        clock.lap("accept", [c.state for c in self.cache])
        self.timing = clock.laps if self.profile else None
        return out

    def propose(self, anchor: mx.array, length: int, pos: int):
        """The ``length - 1`` (>= 1) draft tokens after ``anchor`` [1], the
        first at position ``pos``, in the target's vocabulary, and for p/q
        verification the distributions they were drawn from: (proposal, q or
        None). The draft pass runs while the verify pass is being built."""
        q = None
        # The draft runs on this round's block only, as the reference does:
        # filling the trained block guessed a little better (tau 1.31 against
        # 1.27 at block 2 on SmolLM2), never enough to pay for the longer pass.
        kw = {"steps": self.steps, "vocab": self.vocab} if self.steps > 1 else {}
        logits = self.draft.propose(
            anchor, self.dstate.pending, self.dcache, self.target.embed, self.head, length,
            shift=self.dstate.missing, **kw
        )
        self.dstate.pending = None  # now in the draft's cache
        if self.tuner is not None and self.noise is not None:  # the target's noise at the same positions
            noise = self.noise(pos, length - 1)
            proposal = self.tuner.draw(logits, noise if self.vocab is None else noise[:, self.vocab])
        elif self.tuner is not None:
            proposal, q = self.tuner.sample(logits)
        else:
            proposal = mx.argmax(logits, axis=-1)
        mx.async_eval([proposal] if q is None else [proposal, q])
        if q is not None:
            q = self._full(q)
        if self.vocab is not None:
            proposal = self.vocab[proposal]
        return proposal.astype(mx.int32), q

    def commit(self, out: List[int], a: int, f, verified: int) -> List[int]:
        """Book a verified round whose caches are rolled back: queue the kept
        features for the draft, count; the committed tokens."""
        if f is not None:
            self.dstate.extend(f[:, : a + 1])
        self.rounds += 1
        self.committed += a + 1
        self.verified = verified
        logits, seen, block = self._verified
        # Lazy, from the k kept rows only: computed if the caller reads them.
        self.logprobs = process(logits[: a + 1], seen, block[: a + 1], self.processors)
        return out[: a + 1]

    def _plain(self, history: List[int], more: int) -> List[int]:
        """A plain step after ``history``, the next one queued before this
        one's token is read when the next round is a plain step too."""
        pos = len(history)
        y, f, self.logprobs = self.ahead if self.ahead is not None else self._step(mx.array(history[-1:]), pos)
        self.ahead = None
        if self.policy is not None:
            self.policy.took(1)
        if more and self.length(more) == 1:
            self._queue(y, pos + 1)
        out = y.tolist()
        self._check(out)
        if f is not None:
            self.dstate.extend(f)
        elif self.draft is not None:
            self.dstate.skip(1)
        self.timer.learn(1, 0, took=False)
        self.rounds += 1
        self.committed += 1
        self.verified = 1
        return out

    def _deeper(self) -> bool:
        """Whether this round is a probe whose deeper drafts can be checked
        against the target's next tokens (greedy, exact)."""
        return self.greedy and self.threshold is None and self.policy is not None and self.policy.probe

    def _check(self, tokens: List[int]) -> None:
        """Teach the policy whether a probe's drafts beyond its block were
        the target's ``tokens`` (just committed, in order), up to the first miss."""
        if self._unchecked is None:
            return
        (drafts, depth), self._unchecked = self._unchecked, None
        for i, (t, d) in enumerate(zip(tokens, drafts)):
            self.policy.saw(depth + i, t == d)
            if t != d:
                return
        if len(drafts) > len(tokens):
            self._unchecked = (drafts[len(tokens) :], depth + len(tokens))

    def remember(self, draft) -> None:
        """Keep the tuner's temperature for the next generation with ``draft``
        (the policy is kept per draft as it learns)."""
        if self.tuner is not None:
            self.tuner.remember(draft)
        self.timer.end()

    def _queue(self, token: mx.array, pos: int) -> None:
        """Queue the plain step after ``token`` [1] (its token at ``pos``)
        before that token is read."""
        self.ahead = self._step(token, pos)
        # The features too: left lazy until the next drafting round, they cost
        # ~2% of a toy target's plain step (measured 2026-12-06).
        mx.async_eval([a for a in self.ahead[:2] if a is not None])

    def _step(self, token: mx.array, pos: int):
        """The target's next token [1] after ``token`` [1] (at position
        ``pos``), lazily, with the features and the log-probabilities, chosen
        by :meth:`pick` as mlx-lm's loop does (greedy: the argmax of the
        log-probabilities). greedy() pays off only in verification, where 16
        rows would each need an exp over the vocabulary: on one row its extra
        ops cost more (block 1 went from 0.977-0.987 to 0.988-0.990 of
        mlx-lm, toy target, one core, 2026-12-06)."""
        quiet = self.skips and self.policy.quiet(RECENT)
        logits, f, _ = self.target.forward(token, self.cache, [] if quiet else self.layer_ids)
        logp = process(logits, None, None, None)
        return self.pick(logits, logp, pos), f, logp

    def settle(self) -> None:
        """Take a queued step back out of the caches (the generation ended)."""
        if self.ahead is not None:
            self.ahead = None
            for c in self.cache:
                c.trim(1)

    def _choose(self, logits, history, block, proposal, exact=False, q=None):
        """The tokens for the block, as a list (the first ``a + 1`` are
        committed), and how many drafts ``a`` they accept: the target's own
        choices, or with ``q`` (the distributions the drafts were sampled
        from) the p/q rule's tokens."""
        seen = mx.array(history[:-1]) if self.processors else None
        n = block.shape[0]
        self._verified = logits, seen, block
        # Sampled rows skip the log-softmax (an exp per entry) unless logits
        # processors need it: the filters, the softmax and the draw ignore a shift.
        if q is not None and proposal is not None:
            p = self.dist(process(logits, seen, block, self.processors) if self.processors else logits)
            near = near_top(p, proposal, self.threshold) if self.threshold is not None else None
            choice, a = speculative(p, q, proposal, near)
            out = self.timer.agree(mx.concatenate([choice, a.reshape(1)]), block)
            self._tune(out[n], proposal.shape[0], p, probs=True)
            return out[:n], out[n]
        tops = None  # greedy(): each row's count of near-top entries
        if self.noise is not None:
            logp = process(logits, seen, block, self.processors)  # lazy: see rows()
            x, choice = self.rows(logits, logp), self.pick(logits, logp, len(history))
        elif self.fast and not exact and logits.dtype == mx.float32:
            x = logits
            choice, tops = greedy(logits)
        else:
            x = process(logits, seen, block, self.processors)
            choice = self.sampler(x)
        near = None
        if self.threshold is not None and proposal is not None:
            near = near_top(self.dist(x), proposal, self.threshold)
        parts = [p.astype(mx.int32) for p in (choice, near, tops) if p is not None]
        out = self.timer.agree(mx.concatenate(parts) if len(parts) > 1 else parts[0], block)
        if tops is not None and any(t != 1 for t in out[-n:]):  # rare: redo this block exactly
            return self._choose(logits, history, block, proposal, exact=True)
        tokens, a = out[:n], 0
        if proposal is not None:
            drafts = proposal.tolist()
            a = accepted(drafts, tokens, out[n : 2 * n - 1] if near is not None else None)
            if near is not None:  # accepted drafts may differ from the target's choices
                tokens = drafts[:a] + tokens[a:]
            if self.noise is not None:
                self._tune(a, n - 1, x)
        return tokens, a

    def _tune(self, a: int, n: int, x: mx.array, probs: bool = False) -> None:
        """Teach the tuner (if the drafts were sampled) from a round that
        accepted ``a`` of ``n`` drafts, given the target's rows ``x``: what
        :meth:`pick` draws from, or with ``probs`` its probabilities."""
        if self.tuner is not None:
            rows = min(a + 1, n)
            self.tuner.learn(rows, x[:rows] if probs else self.dist(x[:rows]), self.vocab)

    def _full(self, q: mx.array) -> mx.array:
        """Draft probabilities over the target's vocabulary rows."""
        if self.vocab is None:
            return q
        full = mx.zeros((q.shape[0], self.target.vocab_rows), q.dtype)
        idx = mx.broadcast_to(self.vocab[None], q.shape)
        return mx.put_along_axis(full, idx, q, axis=-1)


class _Clock:
    """Phase times of one round; only synchronises when profiling."""

    def __init__(self, on: bool):
        self.on, self.laps, self.t = on, {}, time.perf_counter()

    def lap(self, name: str, arrays) -> None:
        if self.on:
            mx.eval(arrays)
            now = time.perf_counter()
            self.laps[name] = now - self.t
            self.t = now


def generate(
    model: nn.Module,
    draft: Optional[DFlashDraft],
    tokenizer,
    prompt: Union[str, List[int], mx.array],
    verbose: bool = False,
    **kwargs,
) -> str:
    """Generate the full text; with ``verbose`` stream it and print statistics.

    Takes the arguments of :func:`stream_generate`.
    """
    text, last = "", None
    for last in stream_generate(model, draft, tokenizer, prompt, **kwargs):
        if verbose:
            print(last.text, end="", flush=True)
        text += last.text
    if verbose:
        print()
        print_stats(last)
    return text


def print_stats(r: GenerationResponse, out=None) -> None:
    """mlx-lm style statistics lines, plus the mean acceptance length."""
    import sys

    out = out or sys.stdout
    print(f"Prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.3f} tokens-per-sec", file=out)
    print(f"Generation: {r.generation_tokens} tokens, {r.generation_tps:.3f} tokens-per-sec", file=out)
    print(f"Mean acceptance length: {r.mean_accepted:.2f} tokens per round ({r.rounds} rounds)", file=out)
    print(f"Peak memory: {r.peak_memory:.3f} GB", file=out)

