"""Gaps in the draft's context: plain steps taken while plain steps win and
no probe is near record no features, and the draft's cache skips their
positions (dflash_mlx.engine.decoding.DraftCache.skip). What follows a gap
keeps its true positions; the output stays exactly the target's."""

import mlx.core as mx
import pytest

from dflash_mlx import stream_generate
from dflash_mlx.engine import decoding
from dflash_mlx.engine.decoding import RECENT, DraftCache
from dflash_mlx.engine.policy import Policy
from test_policy import PROMPTS, modelled  # noqa: F401 (a fixture)
from util import mlx_tokens


def _features(draft, n: int) -> mx.array:
    width = len(draft.config.target_layer_ids) * draft.config.hidden_size
    return mx.random.normal((1, n, width), key=mx.random.key(n))


def _block(draft) -> mx.array:
    return mx.random.normal((1, 4, draft.config.hidden_size), key=mx.random.key(7))


def test_context_after_a_gap_keeps_its_positions(loaded, draft_for):
    """Reading positions 0-4, then (after a gap of 10) 15-19, caches at every
    layer the same keys and values as reading all 20 at once, at those rows."""
    _, _, folder = loaded("qwen3")
    draft = draft_for(folder)
    x = _features(draft, 20)
    whole, gapped = draft.make_cache(), draft.make_cache()
    draft(_block(draft), x, whole)
    draft(_block(draft), x[:, :5], gapped)
    draft(_block(draft), x[:, 15:], gapped, shift=10)
    for w, g in zip(whole, gapped):
        rows = mx.concatenate([w.keys[:, :, :5], w.keys[:, :, 15:20]], axis=2)
        assert mx.allclose(g.keys[:, :, :10], rows, atol=1e-5)
        vals = mx.concatenate([w.values[:, :, :5], w.values[:, :, 15:20]], axis=2)
        assert mx.allclose(g.values[:, :, :10], vals, atol=1e-5)
    # The same reads without the shift put the second part at 5-9: other keys.
    unshifted = draft.make_cache()
    draft(_block(draft), x[:, :5], unshifted)
    draft(_block(draft), x[:, 15:], unshifted)
    assert not mx.allclose(unshifted[0].keys[:, :, 5:10], gapped[0].keys[:, :, 5:10], atol=1e-3)


def test_draft_cache_trims_across_gaps(loaded, draft_for):
    """Read 5, a gap of 3, 4 pending (read when the next gap opens), a gap
    of 2, 3 pending: 17 tokens covered. Trimmed one token at a time, the read
    positions left are always those before the cut, and the gaps shrink and go."""
    _, _, folder = loaded("qwen3")
    draft = draft_for(folder)
    d = DraftCache(draft)
    x = _features(draft, 17)
    layout = "RRRRR" + "ggg" + "RRRR" + "gg" + "ppp"
    draft(_block(draft), x[:, :5], d.cache)
    d.skip(3)
    d.extend(x[:, 8:12])
    d.skip(2)  # what is pending is read first, at its own positions
    assert d.gaps == [[5, 3], [9, 2]] and d.pending is None
    whole = draft.make_cache()
    draft(_block(draft), x, whole)
    assert mx.allclose(d.cache[0].keys[:, :, 5:9], whole[0].keys[:, :, 8:12], atol=1e-5)
    d.extend(x[:, 14:])
    assert d.size == len(layout) and d.missing == 5 and d.recent == 3
    for n in range(len(layout), 0, -1):
        d.trim(1)
        kept = layout[: n - 1]
        assert d.size == n - 1, n
        assert d.cache[0].offset == kept.count("R"), n
        assert d.missing == kept.count("g"), n
        assert (d.pending.shape[1] if d.pending is not None else 0) == kept.count("p"), n
    assert d.gaps == []


def test_quiet_while_plain_steps_win_and_no_probe_is_near():
    """Plain steps record no features only while plain steps win and no
    probe is due within the steps a draft must read after a gap."""
    def taught(accepted: int) -> Policy:
        p = Policy(8)
        p.time(1, 1.0)
        p.time(8, 3.0)
        for _ in range(20):
            p.learn(8, [accepted])
        p.spent = 100.0
        return p

    p = taught(0)  # a useless draft: plain steps win
    p.lost = 5.0  # probes have lost 5% of the time: none is due
    assert p.quiet(RECENT)
    p.lost = 1.0  # within the budget: probes are due
    assert not p.quiet(RECENT)
    p.lost = 1.01 / (1 - 1 / p.window) ** 8  # due within 16 rounds, not within 8
    assert p.quiet(8) and not p.quiet(16)
    p = taught(7)  # a right draft: drafting wins, once the draft has read enough after a gap
    p.lost = 5.0
    assert not p.quiet(RECENT)
    assert p.choose(ready=False) == 1 and p.choose() == 8


@pytest.mark.parametrize("echo", [False, True])
def test_auto_leaves_gaps_and_stays_lossless(modelled, loaded, draft_for, monkeypatch, echo):  # noqa: F811
    """Pipelined plain steps on the modelled clock: with a random draft plain
    steps win, most record no features and the draft's context gets gaps; a
    probe runs only with RECENT positions after the last gap. An echo draft
    (right along runs of its token) drafts on. Every output is the target's,
    and the draft cache covers as many tokens as the target's."""
    from mlx_lm.models.cache import make_prompt_cache

    monkeypatch.setattr(decoding, "PIPELINE", True)
    model, tok, folder = loaded("qwen3")
    for prompt in PROMPTS:
        ref = mlx_tokens(model, tok, prompt, 120)
        draft = draft_for(folder, mask_token_id=max(set(ref), key=ref.count), echo=True) if echo else draft_for(folder)
        for _ in range(2):  # the second generation starts with what the first taught
            cache, dcache = make_prompt_cache(model), DraftCache(draft)
            seen, propose = [], draft.propose

            def watch(*a, **k):
                seen.append((k["shift"], dcache.recent))
                return propose(*a, **k)

            draft.propose = watch
            try:
                out = [t for r in stream_generate(model, draft, tok, prompt, block_size="auto", max_tokens=120,
                                                  prompt_cache=cache, draft_cache=dcache) for t in r.tokens]
            finally:
                del draft.propose
            assert out == ref, (prompt, echo)
            assert dcache.size == cache[0].offset
            assert all(recent >= RECENT for shift, recent in seen if shift), seen
        if not echo:
            assert dcache.missing > 60 and any(shift for shift, _ in seen), (dcache.gaps, seen)
