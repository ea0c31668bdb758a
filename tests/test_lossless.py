"""Greedy DFlash output is token-identical to mlx-lm decoding the target alone."""

import pytest

from conftest import ARCHS, HYBRID
from util import dflash_tokens, mlx_run, mlx_tokens, runs

from dflash_mlx import stream_generate

PROMPTS = ["def foo(x):\n    return", "import os\n", "class A:\n"]


@pytest.mark.parametrize("arch", ARCHS)
def test_random_draft_is_lossless(arch, loaded, draft_for):
    model, tok, folder = loaded(arch)
    draft = draft_for(folder)
    for prompt in PROMPTS:
        ref, text = mlx_run(model, tok, prompt, 40)
        for bs in (1, 4, 16):
            out, rs = dflash_tokens(model, draft, tok, prompt, block_size=bs, max_tokens=40)
            assert out == ref, (arch, prompt, bs)
            assert "".join(r.text for r in rs) == text


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_4bit", "gpt_oss", *HYBRID])
def test_accepting_draft_is_lossless(arch, loaded, draft_for):
    """An echo draft (always guesses one token) is accepted along runs of
    that token and rejected mid-block where the run ends. The targets here
    use their embedding as LM head (quantized for qwen3_4bit); gpt_oss has
    sliding-window layers whose rotating caches wrap around within the run."""
    model, tok, folder = loaded(arch, tied=True)
    seen_partial = seen_full = False
    for prompt in PROMPTS:
        ref = mlx_tokens(model, tok, prompt, 60)
        for t in runs(ref)[:2]:
            draft = draft_for(folder, mask_token_id=t, echo=True)
            for bs in (4, 16):
                out, rs = dflash_tokens(model, draft, tok, prompt, block_size=bs, max_tokens=60)
                assert out == ref, (arch, prompt, t, bs)
                acc = [r.accepted for r in rs[1:] if r.finish_reason is None]
                seen_full |= bs in acc
                seen_partial |= any(1 < a < bs for a in acc)
    assert seen_full and seen_partial


def test_max_tokens_and_eos_edges(loaded, draft_for):
    model, tok, folder = loaded("qwen3", tied=True)
    prompt = PROMPTS[0]
    ref = mlx_tokens(model, tok, prompt, 60)
    draft = draft_for(folder, mask_token_id=runs(ref)[-1], echo=True)
    for n in (1, 2, 3, 7, 16, 17, 33):
        out, rs = dflash_tokens(model, draft, tok, prompt, block_size=16, max_tokens=n)
        assert out == ref[:n] and rs[-1].finish_reason == "length"
        assert rs[-1].generation_tokens == n
    # Each distinct token in turn is a stop token: some stop inside an
    # accepted block, some are the bonus token.
    inside = bonus = False
    for stop in dict.fromkeys(ref):
        old = set(tok.eos_token_ids)
        tok.eos_token_ids = old | {stop}
        try:
            want, text = mlx_run(model, tok, prompt, 60)
            out, rs = dflash_tokens(model, draft, tok, prompt, block_size=16, max_tokens=60)
        finally:
            tok.eos_token_ids = old
        assert out == want and out[-1] == stop
        assert "".join(r.text for r in rs) == text
        last = rs[-1]
        assert last.finish_reason == "stop"
        inside |= len(last.tokens) < last.accepted
        bonus |= len(last.tokens) == last.accepted > 1
    assert inside and bonus


def test_draft_runs_on_the_rounds_block(loaded, draft_for):
    """A short round (a smaller block_size, the last tokens before max_tokens)
    runs the draft on its own length only, not on the draft's trained block:
    filling that block guessed barely better and cost a longer pass."""
    model, tok, folder = loaded("qwen3")
    draft = draft_for(folder)
    sizes, propose = [], draft.propose
    draft.propose = lambda *a, **k: sizes.append(a[-1]) or propose(*a, **k)
    out, _ = dflash_tokens(model, draft, tok, PROMPTS[0], block_size=4, max_tokens=10)
    assert out == mlx_tokens(model, tok, PROMPTS[0], 10)
    assert sizes and set(sizes) <= {2, 3, 4} and 4 in sizes and draft.block_size > 4


def test_logprobs_match_mlx_lm(loaded, draft_for):
    """Each token's log-probability row is mlx-lm's, alone (plain steps
    pipelined, accepted blocks, auto) and batched; with a logits processor."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_logits_processors

    from dflash_mlx import Batch

    model, tok, folder = loaded("qwen3", tied=True)
    prompt = PROMPTS[0]
    procs = make_logits_processors(repetition_penalty=1.3, repetition_context_size=8)
    for kw in ({}, {"logits_processors": procs}):
        ref = list(mlx_lm.stream_generate(model, tok, prompt, max_tokens=30, **kw))
        want = mx.stack([r.logprobs for r in ref])
        draft = draft_for(folder, mask_token_id=runs([r.token for r in ref])[0], echo=True)
        for bs in (1, 4, 16, "auto"):
            _, rs = dflash_tokens(model, draft, tok, prompt, block_size=bs, max_tokens=30, **kw)
            assert max(r.accepted for r in rs) > 1 or bs == 1
            got = mx.concatenate([r.logprobs for r in rs])
            assert got.shape == want.shape and mx.allclose(got, want, atol=1e-4).item(), (kw, bs)
    batch = Batch(model, draft, tok, 4)
    keys = [batch.add(p, 30) for p in PROMPTS[:2]]
    got = {k: [] for k in keys}
    while len(batch):
        for k, r in batch.step():
            got[k].append(r.logprobs)
    for k, p in zip(keys, PROMPTS[:2]):
        want = mx.stack([r.logprobs for r in mlx_lm.stream_generate(model, tok, p, max_tokens=30)])
        assert mx.allclose(mx.concatenate(got[k]), want, atol=1e-4).item(), p


@pytest.mark.parametrize("block_size", [1, "auto"])
def test_a_step_queued_at_the_prompt_is_taken_back(loaded, draft_for, monkeypatch, block_size):
    """Where the first round is a plain step, it is queued before the
    prompt's token is read (as mlx-lm's loop does); a generation that ends
    first (by its length or an EOS) takes it back: the cache holds exactly
    the tokens, and a second turn on it is still mlx-lm's. ("auto" first
    learns that plain steps win with a random draft.)"""
    from mlx_lm.models.cache import make_prompt_cache

    model, tok, folder = loaded("qwen3")
    draft = draft_for(folder) if block_size == "auto" else None
    for _ in range(3 if draft else 0):
        dflash_tokens(model, draft, tok, PROMPTS[0], block_size="auto", max_tokens=40)
    ids = tok.encode(PROMPTS[1])
    ref = mlx_tokens(model, tok, PROMPTS[1], 12)
    eos = set(tok.eos_token_ids)
    for n in [k + 1 for k in range(8) if ref[k] not in ref[:k]][:3]:  # an EOS there ends it there
        for stop in (False, True):
            monkeypatch.setattr(tok, "eos_token_ids", eos | {ref[n - 1]} if stop else eos)
            cache = make_prompt_cache(model)
            out, _ = dflash_tokens(model, draft, tok, PROMPTS[1], block_size=block_size,
                                   max_tokens=12 if stop else n, prompt_cache=cache)
            monkeypatch.setattr(tok, "eos_token_ids", eos)
            assert out == ref[:n], (n, stop)
            assert cache[0].offset == len(ids) + n - 1, (n, stop)
            more, _ = dflash_tokens(model, draft, tok, out[-1:], block_size=block_size,
                                    max_tokens=12 - n, prompt_cache=cache)
            assert out + more == ref, (n, stop)


@pytest.mark.parametrize("block_size", [1, 4, "auto"])
def test_a_doubted_argmax_is_redone(loaded, draft_for, monkeypatch, block_size):
    """A greedy verification takes the argmax of the logits (no log-softmax);
    where it is in doubt the block is chosen again from the log-probabilities.
    Here every fast argmax is wrong and doubted: the output is still mlx-lm's,
    and the cache holds exactly the tokens. Plain steps never take the fast
    argmax: they choose as mlx-lm's loop does."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    import dflash_mlx.engine.decoding as decoding

    model, tok, folder = loaded("qwen3")
    real, calls = decoding.greedy, []

    def wrong(logits):
        calls.append(logits.shape[0])
        y, _ = real(logits)
        return (y + 1) % logits.shape[-1], mx.full(y.shape, 2)  # each row in doubt

    monkeypatch.setattr(decoding, "greedy", wrong)
    draft = draft_for(folder) if block_size != 1 else None
    cache = make_prompt_cache(model)
    ids = tok.encode(PROMPTS[0])
    out, _ = dflash_tokens(model, draft, tok, PROMPTS[0], block_size=block_size, max_tokens=20, prompt_cache=cache)
    assert out == mlx_tokens(model, tok, PROMPTS[0], 20)
    assert (len(calls) > 0) == (block_size != 1), calls
    assert cache[0].offset == len(ids) + len(out) - 1


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "gpt_oss"])
def test_prompt_ends_as_mlx_lm_ends_it(arch, loaded, draft_for):
    """The prompt's last token runs alone after the others, as in mlx-lm's
    loop (the head over its row alone, not over a whole chunk's), so the
    first token's log-probabilities are bit for bit mlx-lm's."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    model, tok, folder = loaded(arch)
    draft = draft_for(folder)
    for n in (1, 5, 19):
        ids = [(7 * i + 3) % 200 + 5 for i in range(n)]
        _, want = next(generate_step(mx.array(ids), model, max_tokens=1, prefill_step_size=8))
        for d, bs in ((None, 1), (draft, 4), (draft, "auto")):
            rs = list(stream_generate(model, d, tok, ids, block_size=bs, max_tokens=1, prefill_step_size=8))
            assert mx.array_equal(rs[0].logprobs[0], want).item(), (n, bs)
