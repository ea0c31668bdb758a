"""Generation arguments and interruptions: clear errors, the model stays usable."""

import mlx.core as mx
import pytest

from dflash_mlx import GenerationArgumentError, generate, stream_generate
from util import dflash_tokens, mlx_tokens

BAD = [
    (dict(prompt=""), "prompt is empty"),
    (dict(prompt=[]), "no tokens"),
    (dict(prompt=["a", "b"]), "integer ids"),
    (dict(prompt=[1, 2, 10**6]), "outside the model's vocabulary"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-5), "max_tokens"),
    (dict(block_size=0), "block_size"),
    (dict(block_size=-2), "block_size"),
    (dict(block_size=17), "larger than the draft was trained for"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=-0.2), "top_p"),
    (dict(seed="7"), "seed"),
    (dict(seed=1.5), "seed"),
]


@pytest.mark.parametrize("kw, msg", BAD)
def test_bad_arguments(kw, msg, loaded, draft_for):
    model, tok, folder = loaded("qwen3_5")
    draft = draft_for(folder)
    kw = {"prompt": "import os\n", **kw}
    prompt = kw.pop("prompt")
    with pytest.raises(GenerationArgumentError, match=msg):
        next(stream_generate(model, draft, tok, prompt, **kw))
    with pytest.raises(GenerationArgumentError, match=msg):
        generate(model, draft, tok, prompt, **kw)


def test_prompt_forms(loaded, draft_for):
    model, tok, folder = loaded("qwen3")
    draft = draft_for(folder)
    ids = tok.encode("class A:\n")
    ref = mlx_tokens(model, tok, ids, 15)
    for prompt in ("class A:\n", ids, mx.array(ids)):
        assert dflash_tokens(model, draft, tok, prompt, max_tokens=15)[0] == ref


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])
def test_interrupted_generations_leave_model_usable(arch, loaded, draft_for):
    model, tok, folder = loaded(arch)
    draft = draft_for(folder)
    prompt = "def foo(x):\n    return"
    ref = mlx_tokens(model, tok, prompt, 30)

    for r in stream_generate(model, draft, tok, prompt, block_size=8, max_tokens=30):
        if r.generation_tokens > 3:
            break  # the generator is dropped mid-stream

    calls = [0]

    def ctrl_c(tokens, logits):
        calls[0] += 1
        if calls[0] == 6:
            raise KeyboardInterrupt
        return logits

    with pytest.raises(KeyboardInterrupt):
        dflash_tokens(model, draft, tok, prompt, block_size=8, max_tokens=30, logits_processors=[ctrl_c])

    assert dflash_tokens(model, draft, tok, prompt, block_size=8, max_tokens=30)[0] == ref
    assert mlx_tokens(model, tok, prompt, 30) == ref


def test_caches_that_cannot_roll_back_are_refused(loaded, draft_for):
    from mlx_lm.models.cache import CacheList, KVCache

    from dflash_mlx import UnsupportedModelError

    model, tok, folder = loaded("qwen3")
    draft = draft_for(folder)
    odd = [CacheList(KVCache()) for _ in model.layers]
    with pytest.raises(UnsupportedModelError, match="CacheList"):
        next(stream_generate(model, draft, tok, "import os\n", prompt_cache=odd))
    # plain decoding needs no rollback, and a normal cache still works afterwards
    ref = mlx_tokens(model, tok, "import os\n", 10)
    assert dflash_tokens(model, draft, tok, "import os\n", max_tokens=10)[0] == ref


def test_generate_function_survives_cli_import(loaded, draft_for):
    import importlib

    import dflash_mlx

    importlib.import_module("dflash_mlx.generate")  # rebinds dflash_mlx.generate
    model, tok, folder = loaded("qwen3")
    draft = draft_for(folder)
    text = dflash_mlx.generate(model, draft, tok, "import os\n", max_tokens=8)
    assert text == generate(model, draft, tok, "import os\n", max_tokens=8) != ""
