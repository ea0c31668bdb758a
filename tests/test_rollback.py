"""After a verify pass and rollback, the target's caches hold exactly the state
of feeding only the committed tokens (KV trimmed, gated-DeltaNet replayed)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache

from conftest import HYBRID
from dflash_mlx import stream_generate
from dflash_mlx.engine.rollback import rollback
from dflash_mlx.engine.target import Target
from util import mlx_tokens, runs


def states(cache):
    out = []
    for c in cache:
        if isinstance(c, ArraysCache):
            out += [np.array(c[0]), np.array(c[1])]
        elif isinstance(c, KVCache):
            k, v = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
            out += [np.array(k), np.array(v)]
    return out


def assert_same(cache, fresh):
    a, b = states(cache), states(fresh)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape
        np.testing.assert_allclose(x, y, atol=2e-4, rtol=1e-3)


def fed(target, tokens):
    cache = target.make_cache()
    target.forward(mx.array(tokens), cache, [])
    return cache


@pytest.mark.parametrize("arch", ["qwen3", "gpt_oss", *HYBRID, "gemma4", "kimi_k25"])
def test_rollback_to_every_length(arch, loaded):
    model, tok, _ = loaded(arch)
    target = Target(model)
    prompt = tok.encode("def foo(x):\n    return")
    bs = 8
    block = list(np.random.default_rng(0).integers(0, 300, bs))
    block = [int(t) for t in block]
    for keep in range(1, bs + 1):
        cache = fed(target, prompt)
        _, _, tape = target.forward(mx.array(block), cache, [], record=True)
        rollback(cache, tape, keep, bs)
        fresh = fed(target, prompt + block[:keep])
        assert_same(cache, fresh)
        # and the model continues identically from both (rotating sliding-window
        # caches, compared only this way, may hold their entries in another order)
        nxt = mx.array([7])
        l1, _, _ = target.forward(nxt, cache, [])
        l2, _, _ = target.forward(nxt, fresh, [])
        np.testing.assert_allclose(np.array(l1), np.array(l2), atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("arch", HYBRID)
def test_cache_after_each_round(arch, loaded, draft_for):
    model, tok, folder = loaded(arch, tied=True)
    target = Target(model)
    prompt = tok.encode("import os\n")
    ref = mlx_tokens(model, tok, prompt, 40)
    draft = draft_for(folder, mask_token_id=runs(ref)[0], echo=True)
    cache = target.make_cache()
    out, accepted = [], []
    for r in stream_generate(model, draft, tok, prompt, block_size=8, max_tokens=40, prompt_cache=cache):
        out += r.tokens
        accepted.append(r.accepted)
        if r.finish_reason is None:
            assert_same(cache, fed(target, prompt + out[:-1]))
    assert out == ref
    assert max(accepted) > 1
