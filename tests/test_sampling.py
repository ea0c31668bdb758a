"""At temperature > 0 the output follows the target's own sampling law."""

from collections import Counter

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

import pytest

from conftest import ARCHS
from dflash_mlx.engine.sampling import Noise, accepted, make_draw, make_sampler
from util import dflash_tokens, mlx_tokens, runs

TEMP, TOP_K, N = 1.0, 3, 3


def target_law(model, prompt, n=N):
    """Exact probability of every n-token continuation under top-k sampling."""

    def step(ids):
        logits = model(mx.array(ids)[None])[0, -1:]
        lp = apply_top_k(logits - mx.logsumexp(logits, keepdims=True), TOP_K)
        return np.array(mx.softmax(lp / TEMP, axis=-1))[0]

    law = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for seq, p in law.items():
            probs = step(prompt + list(seq))
            for t in np.nonzero(probs > 0)[0]:
                nxt[seq + (int(t),)] = p * probs[t]
        law = nxt
    return law


def tv(law, counts, total):
    keys = set(law) | set(counts)
    return 0.5 * sum(abs(law.get(k, 0.0) - counts.get(k, 0) / total) for k in keys)


def sampled_law(loaded, draft_for, draws, seeded=True, **kw):
    """The target's exact law of N tokens, and the counts and rounds of
    ``draws`` DFlash generations (block 4; seeded, or after seeding MLX's
    generator) with a draft that always guesses the most likely second token.
    The target has 2 layers (not 6): a draw takes 14 ms instead of 30 here,
    and the rule under test does not depend on the target's depth."""
    model, tok, folder = loaded("qwen3", tied=True, layers=2)
    prompt = tok.encode("import os\n")
    law = target_law(model, prompt)
    draft = draft_for(folder, mask_token_id=max(law, key=law.get)[1], echo=True)
    counts, rounds = Counter(), []
    for seed in range(draws):
        mx.random.seed(seed)
        out, rs = dflash_tokens(
            model, draft, tok, prompt, block_size=4, max_tokens=N,
            temperature=TEMP, top_k=TOP_K, seed=seed if seeded else None, **kw,
        )
        counts[tuple(out)] += 1
        rounds += rs[1:]
    return law, counts, rounds


@pytest.mark.parametrize("seeded", [True, False])
def test_sampled_output_matches_target_distribution(seeded, loaded, draft_for):
    """Argmax proposals against the target's own draws (position-keyed
    noise with a seed, MLX's generator without)."""
    # 1200 draws are needed, not more than needed: the law has 27 outcomes
    # (p from 0.24 down to 0.003), and the TV distance of 1200 exact draws
    # from it is 0.048 +- 0.008 (multinomial simulation), over 0.08 with
    # probability 0.08%; at 600 draws it would be 0.068 +- 0.012 (16%).
    draws = 1200
    law, counts, rounds = sampled_law(loaded, draft_for, draws, seeded, proposal="argmax")
    assert max(r.accepted for r in rounds) > 1, "the draft was never accepted: the test would not test acceptance"
    assert tv(law, counts, draws) < 0.08


def test_seed_is_reproducible_and_private(loaded, draft_for):
    model, tok, folder = loaded("qwen3")
    draft = draft_for(folder)
    state = np.array(mx.random.state[0])
    kw = dict(block_size=4, max_tokens=20, temperature=0.9, top_p=0.95, seed=11)
    a, _ = dflash_tokens(model, draft, tok, "import os\n", **kw)
    b, _ = dflash_tokens(model, draft, tok, "import os\n", **kw)
    c, _ = dflash_tokens(model, draft, tok, "import os\n", **{**kw, "seed": 12})
    assert a == b and a != c
    assert (np.array(mx.random.state[0]) == state).all()


def test_logits_processors_match_mlx_lm(loaded, draft_for):
    model, tok, folder = loaded("qwen3", tied=True)
    prompt = "def foo(x):\n    return"
    procs = make_logits_processors(repetition_penalty=1.3, repetition_context_size=8)
    ref = mlx_tokens(model, tok, prompt, 40, logits_processors=procs)
    assert ref != mlx_tokens(model, tok, prompt, 40)
    for t in runs(ref)[:1] or [ref[0]]:
        draft = draft_for(folder, mask_token_id=t, echo=True)
        for bs in (1, 4, 16):
            out, _ = dflash_tokens(model, draft, tok, prompt, block_size=bs, max_tokens=40, logits_processors=procs)
            assert out == ref


def test_acceptance_rule():
    d = [5, 6, 7]
    assert accepted(d, [5, 6, 7, 9]) == 3
    assert accepted(d, [5, 1, 7, 9]) == 1
    assert accepted(d, [0, 6, 7, 9]) == 0
    assert accepted(d, [0, 1, 7, 9], also=[1, 0, 0]) == 1
    assert make_sampler(0.0)(mx.array([[0.1, 2.0, 0.3]])).tolist() == [1]
    top1 = make_draw(1.0, top_k=1)
    noise = Noise(0, 3)
    assert all(top1(mx.array([[0.1, 2.0, 0.3]]), noise(i, 1)).item() == 1 for i in range(20))


def test_noise_depends_on_seed_and_position_only():
    """However rows are asked for (one at a time, in blocks, overlapping,
    with a prompt cache's tokens before them), position p gets one row."""
    whole = Noise(5, 64)(0, 12)
    parts = Noise(5, 64)
    got = mx.concatenate([parts(0, 3), parts(3, 1), parts(4, 6)[:2], parts(6, 6)])
    assert mx.array_equal(got, whole)
    assert mx.array_equal(Noise(5, 64, held=4)(2, 3), whole[6:9])
    assert not mx.array_equal(Noise(6, 64)(0, 12), whole)
    # Rows are Gumbel: the draws from them follow the softmax.
    logits = mx.array([[0.0, 1.0, 2.0]])
    draw = make_draw(1.0)
    noise = Noise(1, 3)
    counts = np.bincount([draw(logits, noise(i, 1)).item() for i in range(3000)], minlength=3) / 3000
    assert np.abs(counts - np.array(mx.softmax(logits, axis=-1))[0]).max() < 0.03


@pytest.mark.parametrize("arch", ARCHS)
def test_seeded_text_is_the_same_at_every_block_size(arch, loaded, draft_for):
    """A token's draw depends on the seed and its position only: a seeded
    generation is token-identical at every block size, auto and without a
    draft, with drafts that are accepted and proposals drawn or argmax."""
    model, tok, folder = loaded(arch, tied=True)
    prompt = tok.encode("import os\n")
    kw = dict(max_tokens=30, temperature=1.0, top_p=0.95, seed=3)
    ref, _ = dflash_tokens(model, None, tok, prompt, **kw)
    draft = draft_for(folder, mask_token_id=ref[1], echo=True)
    gained = False
    for bs in (1, 2, 4, draft.block_size, "auto"):
        for proposal in ("sample", "argmax"):
            out, rounds = dflash_tokens(model, draft, tok, prompt, block_size=bs, proposal=proposal, **kw)
            assert out == ref, (arch, bs, proposal)
            gained |= max(r.accepted for r in rounds) > 1
    assert gained, "no draft was ever accepted: the test would not test acceptance"


def test_confidence_is_the_top_probability_within_two_hundredths():
    """The draft's confidence builds its exps from float32 bits: within 0.02
    of the top probability however peaked the rows, from bf16 and from
    masked (-inf) logits too."""
    from dflash_mlx.engine.draft import confidence

    rng = np.random.default_rng(1)
    for scale in (0.1, 1.0, 3.0, 8.0, 30.0):
        logits = mx.array(rng.standard_normal((64, 4160), dtype=np.float32) * scale + 20)
        for x in (logits, logits.astype(mx.bfloat16)):
            top = mx.softmax(x.astype(mx.float32), axis=-1).max(axis=-1)
            assert mx.abs(confidence(x) - top).max().item() < 0.02, scale
    masked = mx.concatenate([logits[:, :8], mx.full((64, 100), -mx.inf)], axis=-1)
    assert mx.abs(confidence(masked) - mx.softmax(masked, axis=-1).max(axis=-1)).max().item() < 0.02


def test_distribution_from_raw_logits_matches_mlx_softmax():
    """Sampled rounds feed raw logits (no log-softmax) to the filters and take
    their softmax as powers of 2."""
    from dflash_mlx.engine.sampling import make_distribution, process

    rng = np.random.default_rng(0)
    logits = mx.array(rng.standard_normal((16, 4160), dtype=np.float32) * 6 + 30)
    logp = process(logits, None, None, None)
    for kw in ({"temp": 0.0}, {"temp": 0.7}, {"temp": 1.0, "top_p": 0.9}, {"temp": 0.7, "top_k": 20, "min_p": 0.05}):
        got = make_distribution(**kw)(logits)  # from raw logits
        ref = logp  # what plain decoding filters: log-probabilities
        if "top_p" in kw:
            ref = apply_top_p(ref, kw["top_p"])
        if "min_p" in kw:
            ref = apply_min_p(ref, kw["min_p"])
        if "top_k" in kw:
            ref = apply_top_k(ref, kw["top_k"])
        want = mx.softmax(ref * (1.0 / (kw["temp"] or 1.0)), axis=-1)
        assert ((got > 0) == (want > 0)).all().item(), kw  # the same tokens filtered out
        assert mx.allclose(got, want, rtol=1e-4, atol=1e-7).item(), kw
    # Large logits (top-p's exp of raw values would overflow past ~88) and
    # bf16 ones (raw values over a temperature would round coarsely).
    for x in (logits + 70, logits.astype(mx.bfloat16)):
        ref = apply_top_p(process(x.astype(mx.float32), None, None, None), 0.9)
        want = mx.softmax(ref * (1 / 0.7), axis=-1)
        got = make_distribution(0.7, top_p=0.9)(x)
        assert mx.allclose(got, want, rtol=1e-3, atol=1e-6).item(), x.dtype


def near_tie_logits(rows=3, vocab=4096):
    """Flat rows whose top two logits differ by one float32 step at 0.01: after
    mlx-lm's log-softmax (values near -8.3) they round to the same number, so
    greedy picks the first index there, while a bare argmax picks the second."""
    x = np.zeros((rows, vocab), dtype=np.float32)
    x[:, 5] = np.float32(0.01)
    x[:, 9] = np.nextafter(np.float32(0.01), np.float32(1))
    return mx.array(x)


def test_greedy_fast_path_agrees_with_exact_path():
    from dflash_mlx.engine.sampling import greedy, process

    exact = make_sampler(0.0)
    for seed in range(20):
        rng = np.random.default_rng(seed)
        logits = mx.array(rng.standard_normal((16, 4160), dtype=np.float32) * 4)
        choice, tops = greedy(logits)
        assert tops.tolist() == [1] * 16
        assert choice.tolist() == exact(process(logits, None, None, None)).tolist()
    logits = near_tie_logits()
    assert exact(process(logits, None, None, None)).tolist() == [5, 5, 5]
    assert mx.argmax(logits, axis=-1).tolist() == [9, 9, 9]
    assert greedy(logits)[1].tolist() == [2, 2, 2], "the near-tie was not flagged"
    for top in (np.inf, np.nan, -np.inf):  # a non-finite top: the exact path decides
        x = np.asarray(rng.standard_normal((2, 4160)), dtype=np.float32)
        x[1, 7] = top
        if top == -np.inf:
            x[1] = top
        assert greedy(mx.array(x))[1].tolist()[1] != 1, f"a top of {top} was not flagged"


def test_round_redoes_near_ties_exactly(loaded):
    from dflash_mlx.engine.decoding import _Decoder
    from dflash_mlx.engine.target import Target

    model, _, _ = loaded("qwen3")
    dec = _Decoder(Target(model), None, None, None, False, sampler=make_sampler(0.0), greedy=True)
    out, a = dec._choose(near_tie_logits(), [1, 2], mx.array([2, 5, 7]), mx.array([5, 7]))
    # A bare argmax would choose 9 everywhere and accept nothing.
    assert out[:3] == [5, 5, 5] and a == 1


class _NearTieAt:
    """A target instance whose logits at sequence position ``pos`` are a
    near tie (see near_tie_logits), wherever a forward pass computes them."""

    def __init__(self, model, pos: int):
        self._model, self._pos = model, pos

    def __getattr__(self, key):
        return getattr(self._model, key)

    def __call__(self, inputs, cache=None, **kw):
        start = cache[0].offset if cache else 0
        logits = self._model(inputs, cache=cache, **kw)
        if start <= self._pos < start + inputs.shape[-1]:
            logits[:, self._pos - start] = near_tie_logits(1, logits.shape[-1])
        return logits


def test_plain_steps_take_mlx_lms_token_at_near_ties(loaded, draft_for):
    """A plain step at a near tie takes mlx-lm's token (the argmax of the
    log-probabilities, not of the logits), queued steps included (block 4:
    the verification's redo)."""
    model, tok, folder = loaded("qwen3")
    prompt = "import os\n"
    pos = len(tok.encode(prompt)) + 3
    tied = _NearTieAt(model, pos)
    ref = mlx_tokens(tied, tok, prompt, 12)
    assert ref[pos - len(tok.encode(prompt)) + 1] == 5  # the exact path's choice (a bare argmax: 9)
    for bs in (1, 4):
        out, _ = dflash_tokens(tied, draft_for(folder), tok, prompt, block_size=bs, max_tokens=12)
        assert out == ref, bs
