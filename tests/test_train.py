"""The draft trainer: its training path matches the decoding path, its loss
falls, and what it saves decodes losslessly. Also guards the shipped demo pair."""

import json
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dflash_mlx import load, load_draft, stream_generate
from dflash_mlx.models.config import DFlashConfig
from dflash_mlx.training.data import Sequence, read_records, regen_prompts, regenerate, sequences
from dflash_mlx.engine.draft import DFlashDraft
from dflash_mlx.engine.target import Target
from dflash_mlx.training.train import TrainArgs, block_logits, main, make_batch, next_anchors, train

from tiny import corpus_files, make_target

DEMO = Path(__file__).resolve().parent.parent / "dflash_mlx" / "demo"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_target(tmp_path_factory.mktemp("target"), "qwen3", layers=4)
    model, tok = load(str(folder))
    return folder, model, tok


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    for f in corpus_files(4):
        (d / Path(f).name).write_text(Path(f).read_text()[:3000])
    return d


def _draft(model, bs=4, layers=2, seed=3, window=None, slide=("sliding_attention", "full_attention")):
    t = Target(model)
    cfg = DFlashConfig(
        hidden_size=t.hidden_size, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=t.vocab_rows,
        mask_token_id=t.vocab_rows - 16, target_layer_ids=[1, 3], num_target_layers=t.num_layers,
        rope_theta=10000.0, block_size=bs,
        layer_types=list(slide)[:layers] if window else None,
        sliding_window=window,
    )
    mx.random.seed(seed)
    d = DFlashDraft(cfg)
    mx.eval(d.parameters())
    return d


@pytest.mark.parametrize("window,slide", [(None, ()), (6, ("sliding_attention", "full_attention")),
                                          (6, ("sliding_attention",) * 2)])
def test_training_path_matches_decoding_path(tiny, window, slide):
    """Logits of many anchors at once (training) == draft.propose after the
    same context went through the cache (decoding), block by block; also for
    a draft with a sliding-window layer (window 6 < most anchors), and one
    whose layers all slide (decoding then never computes the context K/V
    that slid out of the window)."""
    _, model, _ = tiny
    t, bs = Target(model), 4
    draft = _draft(model, bs, window=window, slide=slide)
    rng = np.random.default_rng(0)
    toks = mx.array(rng.integers(0, 300, size=(2, 24)), dtype=mx.int32)
    _, feats = t.hidden(toks, draft.config.target_layer_ids)
    anchors = np.array([[1, 5, 11], [3, 9, 20]])
    blocks = np.take_along_axis(np.array(toks)[:, None], anchors[..., None] + np.arange(bs), 2)
    blocks[..., 1:] = draft.config.mask_token_id
    got = block_logits(draft, t, feats, mx.array(blocks.reshape(-1, bs)), mx.array(anchors.reshape(-1)))
    for b in range(2):
        for j, a in enumerate(anchors[b]):
            cache = draft.make_cache()
            # Context arrives in two pieces, as over decoding rounds.
            cut = a // 2
            if cut:
                draft.propose(toks[b, cut - 1 : cut], feats[b : b + 1, :cut], cache, t.embed, t.head, bs)
            want = draft.propose(toks[b, a : a + 1], feats[b : b + 1, cut:a], cache, t.embed, t.head, bs)
            np.testing.assert_allclose(np.array(got[b * 3 + j]), np.array(want), atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    folder = make_target(tmp_path_factory.mktemp("hybrid"), "qwen3_5", layers=4, tied=True)
    model, tok = load(str(folder))
    return folder, model, tok


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_features_match_decoding_capture(tiny, hybrid, arch):
    """Batched feature extraction equals the per-token capture of decoding,
    also through gated-DeltaNet layers."""
    _, model, _ = tiny if arch == "qwen3" else hybrid
    t = Target(model)
    toks = mx.array([[5, 9, 31, 7, 2, 44, 18]])
    logits, f = t.hidden(toks, [0, 2])
    cache = t.make_cache()
    l1, f1, _ = t.forward(toks[0, :4], cache, [0, 2])
    l2, f2, _ = t.forward(toks[0, 4:], cache, [0, 2])
    np.testing.assert_allclose(np.array(f), np.array(mx.concatenate([f1, f2], 1)), atol=1e-4)
    np.testing.assert_allclose(np.array(logits[0]), np.array(mx.concatenate([l1, l2])), atol=1e-3)


def test_batch_anchors_stay_in_range(tiny):
    _, model, tok = tiny
    a = TrainArgs(block_size=4, anchors=6, seq_len=16)
    seqs = [Sequence(list(range(1, 11)), 4), Sequence(list(range(1, 17)), 1)]
    toks, blocks, anchors, labels, valid = make_batch(seqs, a, 0, 999, np.random.default_rng(0))
    anchors, labels, valid, blocks = map(np.array, (anchors, labels, valid, blocks))
    assert toks.shape == (2, 16) and blocks.shape == (12, 4)
    assert (anchors[:6] >= 3).all() and (anchors[:6] <= 8).all() and (anchors[6:] <= 14).all()
    assert (blocks[:, 1:] == 999).all() and (blocks[:, 0] == anchors + 1).all()
    # Labels are the following tokens, marked invalid past the sequence end.
    for r in range(12):
        n = 10 if r < 6 else 16
        for k in range(3):
            assert valid[r, k] == (anchors[r] + k + 1 < n)
            if valid[r, k]:
                assert labels[r, k] == anchors[r] + k + 2


def test_next_anchors_are_where_decoding_goes_next():
    """--decode-anchors: moving a block's anchor past its accepted guesses
    (training path) lands where decoding started its next round."""
    model, tok = load(str(DEMO / "target"))
    draft = load_draft(str(DEMO / "draft"))
    prompt = json.loads((DEMO / "prompts.jsonl").read_text().splitlines()[0])["prompt"]
    ids, gen, starts = tok.encode(prompt), [], []
    for r in stream_generate(model, draft, tok, prompt, max_tokens=96, block_size=draft.block_size):
        starts.append(len(ids) + len(gen) + len(r.tokens) - 1)
        gen += r.tokens
    full = ids + gen
    seqs = [Sequence(full, len(ids))]
    a = TrainArgs(block_size=draft.block_size, anchors=len(starts) - 1, seq_len=len(full))
    given = np.array([starts[:-1]])
    toks, blocks, anchors, labels, valid = make_batch(seqs, a, 0, draft.config.mask_token_id, None, given)
    _, feats = Target(model).hidden(toks, draft.config.target_layer_ids)
    moved = next_anchors(draft, Target(model), feats, blocks, anchors, labels, valid, seqs, a)[0]
    inside = np.array(starts[1:]) <= len(full) - 2
    assert inside.sum() > 10 and len(set(np.diff(starts))) > 3
    assert (moved[inside] == np.array(starts[1:])[inside]).all()
    assert (moved[~inside] == given[0][~inside]).all()


def test_regenerate_is_the_targets_greedy_continuation(tiny, data):
    """More prompts than the batch, of many lengths (so they join in waves,
    reordered): each answer is what mlx-lm's own greedy decoding gives."""
    _, model, tok = tiny
    prompts = regen_prompts(tok, read_records(str(data)), 64, 16)[:3]
    prompts = [p[:n] for p in prompts for n in (3, 9, 16)] + [prompts[0][:5]]
    done = []
    seqs = regenerate(model, prompts, 10, set(tok.eos_token_ids), batch=4,
                      on_sequence=lambda i, s: done.append(i))
    assert sorted(done) == list(range(len(prompts))) and done != sorted(done)
    for p, s in zip(prompts, seqs):
        want = [r.token for r in mlx_lm.stream_generate(model, tok, p, max_tokens=10)]
        assert s.start == len(p) and s.tokens == p + want


def test_loss_falls_and_saved_draft_is_lossless(tiny, data, tmp_path):
    folder, model, tok = tiny
    seqs = regenerate(model, regen_prompts(tok, read_records(str(data)), 64, 16), 48,
                      set(tok.eos_token_ids), batch=16)
    assert all(len(s.tokens) > 16 and s.start == 16 for s in seqs)
    losses, taus = [], []
    a = TrainArgs(block_size=16, depth=2, seq_len=64, anchors=8, batch_size=4, steps=40,
                  lr=3e-3, checkpoint_every=0)
    train(model, tok, seqs, str(tmp_path / "d"), a,
          on_step=lambda s, l, acc, tau: (losses.append(l), taus.append(tau)))
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])
    assert np.mean(taus[-5:]) > np.mean(taus[:5])

    draft = load_draft(str(tmp_path / "d"))
    assert draft.config.block_size == 16 and draft.config.num_hidden_layers == 2
    prompt = "def walk(self, node):\n"
    want = [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=40)]
    for bs in (1, 4, 16):
        got = [t for r in stream_generate(model, draft, tok, prompt, block_size=bs, max_tokens=40)
               for t in r.tokens]
        assert got == want, bs


def test_trains_for_a_hybrid_target(hybrid, data, tmp_path):
    """A Qwen3.5-style (gated-DeltaNet) target: the loss falls and the draft
    decodes token-identically to mlx-lm."""
    folder, model, tok = hybrid
    seqs = regenerate(model, regen_prompts(tok, read_records(str(data)), 48, 12), 36,
                      set(tok.eos_token_ids), batch=16)
    losses = []
    a = TrainArgs(block_size=8, depth=2, seq_len=48, anchors=8, batch_size=4, steps=40,
                  lr=3e-3, checkpoint_every=0)
    train(model, tok, seqs, str(tmp_path / "d"), a, on_step=lambda s, l, acc, tau: losses.append(l))
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])
    draft = load_draft(str(tmp_path / "d"))
    prompt = "class Walker:\n"
    want = [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=30)]
    for bs in (1, 8):
        got = [t for r in stream_generate(model, draft, tok, prompt, block_size=bs, max_tokens=30)
               for t in r.tokens]
        assert got == want, bs


def test_init_starts_from_a_draft(tiny, data, tmp_path, capsys):
    """--init fine-tunes an existing draft: its weights are the starting point
    (lr 0 keeps them; exactly, from the float32 side file of a draft trained
    here), and a draft of another shape is refused in one line."""
    folder, model, tok = tiny
    seqs = sequences(tok, read_records(str(data)), 48)
    a = TrainArgs(block_size=8, depth=2, seq_len=48, anchors=4, batch_size=2, steps=2, lr=3e-3,
                  checkpoint_every=0)
    src = train(model, tok, seqs, str(tmp_path / "src"), a)
    tuned = train(model, tok, seqs, str(tmp_path / "tuned"),
                  replace(a, lr=0.0, seed=9, init=str(tmp_path / "src")))
    want = dict(tree_flatten(src.parameters()))
    for k, v in tree_flatten(tuned.parameters()):
        assert mx.array_equal(v, want[k]).item(), k
    for f in (tmp_path / "src").glob("train_state.*"):
        f.unlink()  # a published draft: bfloat16 weights only
    tuned = train(model, tok, seqs, str(tmp_path / "tuned"), replace(a, lr=0.0, init=str(tmp_path / "src")))
    for k, v in tree_flatten(tuned.parameters()):
        assert v.dtype == mx.float32 and mx.allclose(v, want[k], atol=1e-2).item(), k
    args = ["--model", str(folder), "--data", str(data), "--out", str(tmp_path / "o"), "--depth", "1",
            "--block-size", "8", "--seq-len", "48", "--steps", "1", "--init", str(tmp_path / "src")]
    capsys.readouterr()
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --init draft") and "num_hidden_layers" in err and "\n" not in err


def test_context_window_is_saved_and_lossless(tiny, data, tmp_path):
    """--context-window: the saved draft's layers slide over that many past
    positions (fewer than the prompt here), and it decodes losslessly."""
    _, model, tok = tiny
    seqs = sequences(tok, read_records(str(data)), 48)
    a = TrainArgs(block_size=8, depth=2, seq_len=48, anchors=4, batch_size=2, steps=2, checkpoint_every=0,
                  context_window=12)
    train(model, tok, seqs, str(tmp_path / "d"), a)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention"] * 2 and cfg["sliding_window"] == 12
    train(model, tok, seqs, str(tmp_path / "tuned"), replace(a, context_window=None, init=str(tmp_path / "d")))
    assert json.loads((tmp_path / "tuned" / "config.json").read_text())["sliding_window"] == 12  # inherited
    draft = load_draft(str(tmp_path / "d"))
    prompt = tok.decode(seqs[0].tokens[:40])
    want = [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=30)]
    for bs in (1, 8):
        got = [t for r in stream_generate(model, draft, tok, prompt, block_size=bs, max_tokens=30) for t in r.tokens]
        assert got == want, bs


def test_cli_trains_resumes_and_reports_tau(tiny, data, tmp_path, capsys):
    folder, _, _ = tiny
    out = tmp_path / "draft"
    args = ["--model", str(folder), "--data", str(data), "--out", str(out), "--block-size", "8",
            "--depth", "1", "--seq-len", "48", "--anchors", "4", "--batch-size", "2",
            "--eval-prompts", "0", "--checkpoint-every", "2"]
    assert main(args + ["--steps", "3"]) == 0
    assert json.loads((out / "train_state.json").read_text())["step"] == 3
    moved = tmp_path / "moved"
    assert main(args + ["--out", str(moved), "--minutes", "0.03", "--decode-anchors"]) == 0
    assert json.loads((moved / "train_state.json").read_text())["step"] >= 1
    assert main(args + ["--steps", "5", "--resume"]) == 0
    assert json.loads((out / "train_state.json").read_text())["step"] == 5
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["block_size"] == 8 and cfg["dflash_config"]["target_layer_ids"] == [2]
    capsys.readouterr()
    jl = tmp_path / "p.jsonl"
    jl.write_text("".join(json.dumps({"prompt": f"import os{i}\n"}) + "\n" for i in range(3)))
    assert main(args + ["--steps", "2", "--eval-data", str(jl), "--eval-prompts", "2",
                        "--eval-tokens", "12", "--regenerate", "--regen-tokens", "8"]) == 0
    assert "held-out prompts:" in capsys.readouterr().out
    # --resume reuses the regenerated data instead of generating it again.
    assert (out / "train_regenerated.jsonl").exists()
    assert main(args + ["--steps", "3", "--resume", "--regenerate", "--eval-prompts", "0"]) == 0
    assert "reusing" in capsys.readouterr().err


def test_data_formats(tiny, tmp_path):
    """Text is cut into chunks; chat records train on the assistant reply only,
    with the tokenizer's chat template applied."""
    _, _, tok = tiny
    jl = tmp_path / "d.jsonl"
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x = 1\ny = 2"}]
    jl.write_text(json.dumps({"messages": chat}) + "\n" + json.dumps({"text": "a b c " * 40}) + "\n"
                  + json.dumps({"prompt": "def f():", "completion": " return 1"}) + "\n")
    recs = read_records(str(jl))
    seqs = sequences(tok, recs, 32)
    prompt = tok.apply_chat_template(chat[:1], add_generation_prompt=True, tokenize=True)
    full = tok.apply_chat_template(chat, tokenize=True)
    assert seqs[0].tokens == list(full) and seqs[0].start == len(prompt)
    text = tok.encode("a b c " * 40, add_special_tokens=False)
    assert [t for s in seqs[1:-1] for t in s.tokens] == text and all(s.start == 1 for s in seqs[1:-1])
    p_ids = tok.encode("def f():", add_special_tokens=False)
    assert seqs[-1].tokens == p_ids + tok.encode(" return 1", add_special_tokens=False)
    assert seqs[-1].start == len(p_ids)
    assert regen_prompts(tok, recs[:1], 32, 8) == [list(prompt)]


@pytest.mark.parametrize("bad", ["model", "data", "empty"])
def test_cli_bad_input_is_one_line(tiny, data, tmp_path, capsys, bad):
    folder, _, _ = tiny
    empty = tmp_path / "empty"
    empty.mkdir()
    m = str(tmp_path / "nope") if bad == "model" else str(folder)
    d = {"data": str(tmp_path / "missing"), "empty": str(empty)}.get(bad, str(data))
    assert main(["--model", m, "--data", d, "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and "Traceback" not in err


@pytest.mark.skipif(not (DEMO / "draft" / "config.json").exists(), reason="demo pair not built")
def test_demo_pair_is_lossless_and_accepts():
    """The shipped pair, on the held-out prompts the build evaluates on (8
    spread over the set, 128 tokens): token-identical to mlx-lm greedy and a
    mean acceptance well above a broken draft's 1. At the draft's block: what
    "auto" chooses depends on the clock, which the other test worker shares."""
    model, tok = load(str(DEMO / "target"))
    draft = load_draft(str(DEMO / "draft"))
    prompts = [json.loads(l)["prompt"] for l in (DEMO / "prompts.jsonl").read_text().splitlines()]
    rounds = committed = 0
    for p in prompts[:: max(1, len(prompts) // 8)][:8]:
        want = [r.token for r in mlx_lm.stream_generate(model, tok, p, max_tokens=128)]
        got, last = [], None
        for last in stream_generate(model, draft, tok, p, block_size=draft.block_size, max_tokens=128):
            got.extend(last.tokens)
        assert got == want
        rounds, committed = rounds + last.rounds, committed + last.committed
    assert committed / rounds > 2


def test_progress_lines_when_steps_skip():
    """Written to a file, the bar reports about every 1/50th of the run, also
    when updates jump by more than one step (regeneration reports per batch)."""
    import io

    from dflash_mlx.training.train import Progress

    out = io.StringIO()
    bar = Progress(3072, "regenerate", out=out)
    for done in range(64, 3073, 64):
        bar.last = 0.0  # as if the 0.5 s throttle had passed
        bar.update(done, 64)
    lines = out.getvalue().splitlines()
    assert len(lines) >= 40 and lines[-1].startswith("regenerate 3072/3072")
