"""Issue #15 variants: quantized drafts, lenient acceptance (accept_threshold),
several denoising passes per draft (denoise_steps), sampled proposals."""

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from tiny import make_draft
from util import count_pq, dflash_tokens, mlx_run, runs

from dflash_mlx import GenerationArgumentError, load_draft
from dflash_mlx.engine import proposal
from dflash_mlx.errors import DraftConfigError, DraftWeightsError
from dflash_mlx.models.loading import save_draft
from dflash_mlx.engine.policy import memo

PROMPTS = ["def foo(x):\n    return", "import os\n"]


def quantized_layers(draft):
    return [n for n, m in draft.named_modules() if isinstance(m, nn.QuantizedLinear)]


def assert_lossless(model, tok, draft, n=30, **kw):
    for prompt in PROMPTS:
        ref, text = mlx_run(model, tok, prompt, n)
        for bs in (4, "auto"):
            extra = {}
            out, rs = dflash_tokens(model, draft, tok, prompt, block_size=bs, max_tokens=n, **extra, **kw)
            assert out == ref, (prompt, bs, kw)
            assert "".join(r.text for r in rs) == text


# ------------------------------------------------------------ 1. quantized drafts


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_draft_is_lossless(arch, bits, loaded, tmp_path):
    model, tok, folder = loaded(arch, tied=True)
    ref, _ = mlx_run(model, tok, PROMPTS[0], 40)
    src = make_draft(tmp_path / "draft", folder, mask_token_id=runs(ref)[0], echo=True)
    draft = load_draft(str(src), bits=bits, group_size=32)
    names = quantized_layers(draft)
    # fc, q/k/v/o, gate/up and down (input 96, which 32 divides) in both layers.
    assert "fc" in names and len(names) == 1 + 2 * 7
    assert all(draft.layers[0].mlp.gate_proj.bits == bits for _ in [0])
    assert_lossless(model, tok, draft)
    # Later denoising passes bring no new features: zero rows for the quantized fc.
    assert_lossless(model, tok, draft, denoise_steps=2)
    # Saved quantized, loaded back as such: same structure, same proposals.
    save_draft(draft, str(tmp_path / "saved"))
    cfg = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 32, "bits": bits}
    again = load_draft(str(tmp_path / "saved"))
    assert quantized_layers(again) == names
    assert_lossless(model, tok, again)
    _, rs = dflash_tokens(model, again, tok, PROMPTS[0], block_size=16, max_tokens=40)
    assert max(r.accepted for r in rs) > 1, "the quantized echo draft was never accepted"


def test_group_size_skips_layers_it_does_not_divide(loaded, tmp_path):
    _, _, folder = loaded("qwen3")
    draft = load_draft(str(make_draft(tmp_path / "d", folder)), bits=8)  # group 64
    names = quantized_layers(draft)
    assert "layers.0.mlp.gate_proj" in names and "layers.0.mlp.down_proj" not in names


def test_wrong_group_size_is_one_line_error(loaded, tmp_path):
    _, _, folder = loaded("qwen3")
    src = make_draft(tmp_path / "d", folder)
    with pytest.raises(DraftConfigError) as e:
        load_draft(str(src), bits=4, group_size=48)
    assert "\n" not in str(e.value)
    with pytest.raises(DraftConfigError):
        load_draft(str(src), bits=7)
    save_draft(load_draft(str(src), bits=4, group_size=32), str(tmp_path / "q"))
    cfg_path = tmp_path / "q" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization"]["group_size"] = 64
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(DraftWeightsError) as e:
        load_draft(str(tmp_path / "q"))
    assert "\n" not in str(e.value) and "group_size 64" in str(e.value)
    cfg["quantization"] = {"group_size": 64}
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(DraftConfigError) as e:
        load_draft(str(tmp_path / "q"))
    assert "\n" not in str(e.value)


# ------------------------------------------------------------ 2. accept_threshold


def target_probs(model, ids):
    """Softmax of the target's logits for every next token after ids[:i+1]."""
    logits = model(mx.array(ids)[None])[0].astype(mx.float32)
    return mx.softmax(logits, axis=-1)


def test_no_threshold_is_exact(loaded, draft_for):
    model, tok, folder = loaded("qwen3")
    ref, _ = mlx_run(model, tok, PROMPTS[0], 30)
    out, rs = dflash_tokens(model, draft_for(folder), tok, PROMPTS[0], block_size=4, max_tokens=30)
    assert out == ref and all(r.exact for r in rs)


@pytest.mark.parametrize("bs", [16, "auto"])
def test_threshold_accepts_near_top_tokens_only(bs, loaded, draft_for):
    model, tok, folder = loaded("qwen3", tied=True)
    T, lenient, checked = 0.2, 0, 0
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        ref, _ = mlx_run(model, tok, prompt, 40)
        for t in runs(ref)[:1] + [ref[1]]:
            draft = draft_for(folder, mask_token_id=t, echo=True)
            kw = {}
            out, rs = dflash_tokens(
                model, draft, tok, ids, block_size=bs, max_tokens=40, accept_threshold=T, **kw
            )
            assert not any(r.exact for r in rs)
            probs = target_probs(model, ids + out)
            top = probs.max(axis=-1)
            pos = len(ids) - 1  # the row that chose out[0]
            for r in rs:
                for j, token in enumerate(r.tokens):
                    p, best = probs[pos, token].item(), top[pos].item()
                    if j < r.accepted - 1:  # a draft the rule accepted
                        assert p >= T * best * (1 - 1e-4), (prompt, pos, p, best)
                        lenient += p < best * (1 - 1e-4)
                        checked += 1
                    else:  # the target's own (greedy) choice
                        assert p >= best * (1 - 1e-4)
                    pos += 1
    assert checked and lenient, "no near-top draft token was accepted: the test would not test the rule"


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.5, True, "0.5"])
def test_bad_threshold_is_refused(bad, loaded, draft_for):
    model, tok, folder = loaded("qwen3")
    with pytest.raises(GenerationArgumentError):
        dflash_tokens(model, draft_for(folder), tok, PROMPTS[0], max_tokens=4, accept_threshold=bad)


# ------------------------------------------------------------ 3. denoise_steps


@pytest.mark.parametrize("steps", [2, 3])
def test_denoising_is_lossless(steps, loaded, draft_for):
    model, tok, folder = loaded("qwen3", tied=True)
    assert_lossless(model, tok, draft_for(folder), denoise_steps=steps)
    ref, _ = mlx_run(model, tok, PROMPTS[1], 40)
    echo = draft_for(folder, mask_token_id=runs(ref)[0], echo=True)
    assert_lossless(model, tok, echo, denoise_steps=steps)
    _, rs = dflash_tokens(model, echo, tok, PROMPTS[1], block_size=16, max_tokens=40, denoise_steps=steps)
    assert max(r.accepted for r in rs) > 1


def test_denoising_keeps_the_surest_guesses(loaded, draft_for):
    from dflash_mlx.engine.target import Target

    model, tok, folder = loaded("qwen3")
    draft, t = draft_for(folder), Target(model)
    ids = mx.array(tok.encode(PROMPTS[0]))
    feats = t.features(ids[None], draft.config.target_layer_ids)
    anchor = ids[-1:]

    def run(steps):
        cache = draft.make_cache()
        logits = draft.propose(anchor, feats, cache, t.embed, t.head, 16, steps=steps)
        assert cache[0].offset == feats.shape[1]  # context read once, no block kept
        return logits

    one, two = run(1), run(2)
    sure = mx.softmax(one, axis=-1).max(axis=-1)
    kept = mx.argsort(-sure)[:7].tolist()
    rest = sorted(set(range(15)) - set(kept))
    assert mx.allclose(two[mx.array(kept)], one[mx.array(kept)]).item()
    assert not mx.allclose(two[mx.array(rest)], one[mx.array(rest)]).item()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_denoise_steps_are_refused(bad, loaded, draft_for):
    model, tok, folder = loaded("qwen3")
    with pytest.raises(GenerationArgumentError):
        dflash_tokens(model, draft_for(folder), tok, PROMPTS[0], max_tokens=4, denoise_steps=bad)


# ------------------------------------------------------------ 4. sampled proposals


@pytest.mark.parametrize("seeded,scales", [(True, None), (False, None), (False, (0.0,))])
def test_sampled_proposals_follow_target_law(seeded, scales, loaded, draft_for, monkeypatch):
    """Drafts drawn with the target's noise (seeded), or verified with the
    p/q rule (unseeded), at the tuned temperature; and at s = 0 alone (the
    p/q rule with a one-hot q)."""
    from test_sampling import sampled_law, tv

    if scales is not None:
        monkeypatch.setattr(proposal, "SCALES", scales)
    calls = count_pq(monkeypatch)
    draws = 1200
    law, counts, rounds = sampled_law(loaded, draft_for, draws, seeded, proposal="sample")
    assert (calls[0] == 0) == seeded, calls
    acc = [r.accepted for r in rounds]
    short = sum(r.accepted < r.verified for r in rounds if r.finish_reason is None)
    assert max(acc) > 1 and short, "the test would not test both acceptance and rejection"
    assert tv(law, counts, draws) < 0.08


def test_sampled_proposals_are_reproducible_and_private(loaded, draft_for):
    import numpy as np

    model, tok, folder = loaded("qwen3")
    draft = draft_for(folder)
    state = np.array(mx.random.state[0])
    kw = dict(block_size=4, max_tokens=20, temperature=0.9, top_p=0.95, seed=11, proposal="sample")
    a, _ = dflash_tokens(model, draft, tok, PROMPTS[0], **kw)
    # The second run starts from what the first taught the tuner: other
    # proposals, the same text.
    score = np.array(memo(draft)[("tuner", 0.9, 0.95, 0.0, 0)])
    assert (score != np.array(proposal.Tuner(0.9).score)).any()
    b, _ = dflash_tokens(model, draft, tok, PROMPTS[0], **kw)
    c, _ = dflash_tokens(model, draft, tok, PROMPTS[0], **{**kw, "seed": 12})
    assert a == b and a != c
    assert (np.array(mx.random.state[0]) == state).all()
    d, _ = dflash_tokens(model, draft, tok, PROMPTS[0], **{**kw, "block_size": "auto"})
    assert len(d) == 20


@pytest.mark.parametrize("seeded", [True, False])
@pytest.mark.parametrize("c", [0.5, 2.0])
def test_tuner_finds_the_draft_temperature(seeded, c):
    """A draft whose logits are c times the target's draws at c times the
    target's temperature, as learnt from the rows verified (the p/q rule's
    sum min(p, q), whichever way the drafts are drawn)."""
    temp, vocab = 0.8, mx.array([3, 0, 5, 7, 1, 2])
    tuner = proposal.Tuner(temp)
    assert proposal.SCALES[int(mx.argmax(tuner.score))] == 1.0
    mx.random.seed(0)
    for _ in range(30):
        z = 3 * mx.random.normal((4, 8))
        rows = z[:, vocab]
        if seeded:
            tuner.draw(c * rows, mx.random.gumbel((4, vocab.shape[0])))
        else:
            tokens, q = tuner.sample(c * rows)
            assert q.shape == rows.shape and mx.allclose(q.sum(axis=-1), mx.ones(4))
        tuner.learn(3, mx.softmax(z / temp, axis=-1), vocab)
    assert proposal.SCALES[int(mx.argmax(tuner.score))] == c
    # s = 0 draws the argmax; its q is one-hot.
    tuner.score = (tuner.scales == 0).astype(mx.float32)
    tokens, q = tuner.sample(rows)
    assert (tokens == mx.argmax(rows, axis=-1)).all() and (q.max(axis=-1) == 1).all()
    assert (tuner.draw(rows, 10 * mx.random.gumbel(rows.shape)) == mx.argmax(rows, axis=-1)).all()


def test_sampled_proposals_greedy_unchanged(loaded, draft_for):
    model, tok, folder = loaded("qwen3", tied=True)
    assert_lossless(model, tok, draft_for(folder), proposal="sample")


def test_bad_proposal_is_refused(loaded, draft_for):
    model, tok, folder = loaded("qwen3")
    draft = draft_for(folder)
    with pytest.raises(GenerationArgumentError):
        dflash_tokens(model, draft, tok, PROMPTS[0], max_tokens=4, proposal="top")
    with pytest.raises(GenerationArgumentError):
        dflash_tokens(model, draft, tok, PROMPTS[0], max_tokens=4, proposal="sample",
                      sampler=lambda lp: mx.argmax(lp, axis=-1))


# ------------------------------------------------------------ with a draft vocabulary, and the CLI


def test_variants_with_a_draft_vocabulary(loaded, tmp_path):
    import numpy as np
    from test_draft_vocab import vocab_draft

    model, tok, folder = loaded("qwen3", tied=True)
    V = model.model.embed_tokens.weight.shape[0]
    ref, _ = mlx_run(model, tok, PROMPTS[1], 40)
    vocab = sorted(set(np.random.default_rng(1).permutation(V)[: V // 3].tolist()) | set(runs(ref)[:1]))
    draft = vocab_draft(tmp_path / "d", folder, vocab, mask_token_id=runs(ref)[0], echo=True)
    assert_lossless(model, tok, draft, denoise_steps=2)
    _, rs = dflash_tokens(model, draft, tok, PROMPTS[1], block_size=16, max_tokens=40, denoise_steps=2)
    assert max(r.accepted for r in rs) > 1
    # Seeded (noise over the draft's rows) and not (p/q over the target's
    # rows); a top-k as wide as the draft's vocabulary keeps its rows whole.
    for seed in (0, 1, None):
        out, rs = dflash_tokens(model, draft, tok, PROMPTS[1], block_size=16, max_tokens=40,
                                temperature=0.8, top_k=len(vocab), seed=seed, proposal="sample")
        assert len(out) == 40 or out[-1] in tok.eos_token_ids
        assert all(t in vocab for r in rs[1:] for t in r.tokens[: r.accepted - 1])


def test_cli_flags(loaded, tmp_path):
    from test_cli import cli

    model, tok, folder = loaded("qwen3", tied=True)
    draft = make_draft(tmp_path / "d", folder)
    raw = "import os\n"
    _, want = mlx_run(model, tok, raw, 12)
    base = ["--model", str(folder), "--draft", str(draft), "--prompt", raw, "--no-chat-template", "--max-tokens", "12"]
    r = cli(*base, "--quiet", "--draft-bits", "8", "--denoise-steps", "2")
    assert r.returncode == 0 and r.stdout == want + "\n", r.stderr
    r = cli(*base, "--quiet", "--accept-threshold", "0.5", "--temp", "0.7", "--proposal", "sample", "--seed", "1")
    assert r.returncode == 0 and "not exactly the target's output" in r.stderr, r.stderr
    for flag, value, message in [("--accept-threshold", "0", "accept_threshold"),
                                 ("--denoise-steps", "0", "denoise_steps")]:
        r = cli(*base, flag, value)
        assert r.returncode == 1 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_benchmark_draft_bits(loaded, tmp_path, capsys):
    from dflash_mlx.bench import benchmark as bm

    _, _, folder = loaded("qwen3")
    draft = make_draft(tmp_path / "d", folder)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "import os\n"}) + "\n")
    out = tmp_path / "r.json"
    code = bm.main(["--model", str(folder), "--draft", str(draft), "--dataset", str(prompts),
                    "--max-tokens", "12", "--warmup-tokens", "0", "--temp", "0", "--out", str(out),
                    "--draft-bits", "8"])
    capsys.readouterr()
    res = json.loads(out.read_text())
    assert code == 0 and res["ok"] and res["config"]["draft_bits"] == 8


@pytest.mark.parametrize("seeded", [True, False])
def test_threshold_with_sampled_proposals(seeded, loaded, draft_for):
    """Sampled drafts inside the target's top-k pass a tiny threshold; the
    exact rule alone (coupled draws seeded, p/q unseeded) rejects some of them."""
    model, tok, folder = loaded("qwen3", tied=True)
    ids = tok.encode(PROMPTS[1])
    ref, _ = mlx_run(model, tok, PROMPTS[1], 30)
    draft = draft_for(folder, mask_token_id=runs(ref)[0], echo=True)
    mean = {}
    for T in (None, 1e-6):
        acc = []
        for seed in range(4):
            mx.random.seed(seed)
            out, rs = dflash_tokens(model, draft, tok, ids, block_size=8, max_tokens=30, temperature=1.0,
                                    top_k=3, seed=seed if seeded else None, proposal="sample", accept_threshold=T)
            assert all(r.exact == (T is None) for r in rs)
            acc += [r.accepted for r in rs[1:]]
            if T is not None:
                order = mx.argsort(-target_probs(model, ids + out), axis=-1)[:, :3].tolist()
                pos = len(ids) - 1
                for r in rs:
                    for j, token in enumerate(r.tokens):
                        if j < r.accepted - 1:
                            assert token in order[pos]
                        pos += 1
        mean[T] = sum(acc) / len(acc)
    assert mean[1e-6] > mean[None]
