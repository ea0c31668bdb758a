"""Generation leaves nothing changed: not the model, not mlx-lm, not MLX."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import HYBRID
from dflash_mlx import stream_generate
from util import dflash_tokens, mlx_tokens


def snapshot(model):
    layers = model.layers if hasattr(model, "layers") else model.model.layers
    subs = []
    for l in layers:
        la = getattr(l, "linear_attn", None)
        subs.append((type(l), type(la), type(getattr(la, "conv1d", None))))
    return (
        [id(l) for l in layers],
        subs,
        sorted(k for k, _ in tree_flatten(model.parameters())),
        np.array(mx.random.state[0]),
    )


def same(a, b):
    assert a[0] == b[0] and a[1] == b[1] and a[2] == b[2]
    assert (a[3] == b[3]).all()


class Boom(Exception):
    pass


@pytest.mark.parametrize("arch", ["qwen3", *HYBRID])
def test_nothing_left_changed(arch, loaded, draft_for):
    model, tok, folder = loaded(arch)
    draft = draft_for(folder)
    prompt = "class A:\n"
    ref = mlx_tokens(model, tok, prompt, 30)
    before = snapshot(model)

    dflash_tokens(model, draft, tok, prompt, block_size=4, max_tokens=30, seed=1, temperature=0.5)
    same(before, snapshot(model))

    # closed early, after a few rounds
    gen = stream_generate(model, draft, tok, prompt, block_size=4, max_tokens=30)
    for _ in range(3):
        next(gen)
    gen.close()
    same(before, snapshot(model))

    # an exception inside the loop (a user's logits processor fails mid-way)
    calls = [0]

    def failing(tokens, logits):
        calls[0] += 1
        if calls[0] > 10:
            raise Boom()
        return logits

    with pytest.raises(Boom):
        dflash_tokens(model, draft, tok, prompt, block_size=4, max_tokens=30, logits_processors=[failing])
    same(before, snapshot(model))

    out, _ = dflash_tokens(model, draft, tok, prompt, block_size=4, max_tokens=30)
    assert out == ref
    assert mlx_tokens(model, tok, prompt, 30) == ref


def test_interleaved_generators(loaded, draft_for):
    model, tok, folder = loaded("qwen3_5")
    draft = draft_for(folder)
    prompts = ["import os\n", "def foo(x):\n    return"]
    refs = [mlx_tokens(model, tok, p, 30) for p in prompts]
    gens = [stream_generate(model, draft, tok, p, block_size=4, max_tokens=30) for p in prompts]
    outs = [[], []]
    live = [True, True]
    while any(live):
        for i, g in enumerate(gens):
            if live[i]:
                try:
                    outs[i] += next(g).tokens
                except StopIteration:
                    live[i] = False
    assert outs == refs


@pytest.mark.parametrize("arch", HYBRID)
def test_taps_undone_when_forward_fails(arch, loaded):
    from dflash_mlx.engine.target import Target

    model, _, _ = loaded(arch)
    target = Target(model)
    before = snapshot(model)
    cache = target.make_cache()
    target.forward(mx.array([1, 2, 3]), cache, [1])
    with pytest.raises(Boom):
        with target._taps([1, 2], cache):
            assert snapshot(model)[1] != before[1]
            raise Boom()
    same(before, snapshot(model))


def test_stand_ins_copy_like_what_they_stand_in_for(loaded):
    import copy

    from mlx_lm.models.cache import KVCache

    from dflash_mlx.engine.target import Target, _CacheTap, _LayerInput, _Tap

    model, _, _ = loaded("qwen3")
    target = Target(model)
    for wrapper, name in [(_Tap(target.layers[0], "output"), "mlp"), (_LayerInput(target), "weight"),
                          (_CacheTap(KVCache()), "offset")]:
        # (a deep copy of _LayerInput would copy the Target and its lock)
        for twin in [copy.copy(wrapper)] + ([copy.deepcopy(wrapper)] if name != "weight" else []):
            assert type(twin) is type(wrapper)
            assert type(getattr(twin, name)) is type(getattr(wrapper, name))
        with pytest.raises(AttributeError):
            type(wrapper).__new__(type(wrapper)).anything  # no __init__: an AttributeError, not a RecursionError


def test_two_threads(loaded, draft_for):
    import threading

    model, tok, folder = loaded("qwen3_next")
    draft = draft_for(folder)
    prompts = ["import os\n", "class A:\n"]
    refs = [mlx_tokens(model, tok, p, 30) for p in prompts]
    outs = [None, None]

    def run(i):
        outs[i] = dflash_tokens(model, draft, tok, prompts[i], block_size=4, max_tokens=30)[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outs == refs
