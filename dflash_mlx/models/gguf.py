"""GGUF targets: convert a .gguf file once into an ordinary mlx-lm folder.

The folder (float32 safetensors, config.json, tokenizer.json and
tokenizer_config.json with the chat template) lands in a cache directory
(:func:`cache_root`), keyed by the file's content,
and is then loaded by mlx-lm like any other model folder.
"""

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx
import numpy as np

from ..errors import ModelLoadError, ModelNotFoundError, UnsupportedModelError

ARCHS = ("llama", "qwen2", "qwen3")
VERSION = 2  # of the conversion; part of the cached folder's name

# Hugging Face names of the per-block tensors, by GGUF name.
BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# Pre-tokenizer regexes by tokenizer.ggml.pre (byte-level BPE vocabularies).
_LETTERS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
SPLITS = {
    "qwen2": _LETTERS + r"\p{N}|" + _REST,
    "llama-bpe": _LETTERS + r"\p{N}{1,3}|" + _REST,
}
PRE = ("smollm", "gpt-2", "default") + tuple(SPLITS)


def cache_root() -> Path:
    """Where converted models and what ``auto`` learnt live: ``$DFLASH_MLX_CACHE``,
    else ``$XDG_CACHE_HOME/dflash_mlx`` (``~/.cache/dflash_mlx``)."""
    env = os.environ.get("DFLASH_MLX_CACHE")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash_mlx"


def file_digest(path: Path, chunk: int = 1 << 22) -> str:
    """The sha256 of a file, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def converted(path: str, root: Optional[Path] = None) -> Path:
    """The mlx-lm folder of a .gguf file, converting it on first use.

    The folder is written under a temporary name and renamed, so a failed or
    interrupted conversion leaves nothing behind.
    """
    src = Path(path).expanduser()
    if not src.is_file():
        raise ModelNotFoundError(f"GGUF file '{path}' does not exist.")
    root = root or cache_root()
    out = root / "gguf" / f"{src.stem}-{file_digest(src)[:16]}-v{VERSION}"
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    try:
        tmp.chmod(0o755)
        convert(src, tmp)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "config.json").exists():  # not a concurrent twin
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def convert(src: Path, out: Path) -> None:
    """Write the mlx-lm folder of GGUF file ``src`` into the folder ``out``."""
    try:
        tensors, meta = mx.load(str(src), return_metadata=True)
    except Exception as e:
        raise ModelLoadError(
            f"Cannot read '{src}' as GGUF ({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}); "
            "it may be corrupted or use a tensor type MLX does not read (MLX reads "
            "F32, F16, Q4_0, Q4_1 and Q8_0)."
        ) from None
    arch = _str(meta, "general.architecture")
    if arch not in ARCHS:
        raise UnsupportedModelError(
            f"GGUF architecture '{arch}' is not supported (supported: {', '.join(ARCHS)})."
        )
    config = _config(meta, arch, tensors)
    weights = _weights(tensors, config)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _tokenizer(meta, out)


def _str(meta: Dict, key: str, default=None):
    v = meta.get(key, default)
    if v is None:
        raise ModelLoadError(f"The GGUF metadata lacks '{key}'; is it a language model?")
    return v


def _num(meta: Dict, key: str, default=None):
    v = meta.get(key)
    if v is None:
        if default is None:
            raise ModelLoadError(f"The GGUF metadata lacks '{key}'.")
        return default
    return v.item() if isinstance(v, mx.array) else v


def _config(meta: Dict, arch: str, tensors: Dict) -> Dict:
    if f"{arch}.rope.scaling.type" in meta or "rope_freqs.weight" in tensors:
        raise UnsupportedModelError("GGUF files with RoPE scaling are not supported yet.")
    heads = int(_num(meta, f"{arch}.attention.head_count"))
    hidden = int(_num(meta, f"{arch}.embedding_length"))
    head_dim = int(_num(meta, f"{arch}.attention.key_length", hidden // heads))
    vocab = tensors["token_embd.scales" if "token_embd.scales" in tensors else "token_embd.weight"].shape[0]
    config = {
        "model_type": arch,
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]],
        "hidden_size": hidden,
        "num_hidden_layers": int(_num(meta, f"{arch}.block_count")),
        "intermediate_size": int(_num(meta, f"{arch}.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_num(meta, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(_num(meta, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_num(meta, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_num(meta, f"{arch}.context_length", 4096)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
    }
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = False
    return config


def _weights(tensors: Dict, config: Dict) -> Dict[str, mx.array]:
    """Float32 weights under Hugging Face names, q/k rows un-permuted for llama."""
    out = {}
    for name, w in tensors.items():
        base, _, kind = name.rpartition(".")
        if kind in ("scales", "biases") and f"{base}.weight" in tensors:
            continue
        if kind == "weight" and f"{base}.scales" in tensors:
            w = _dequantize(w, tensors[f"{base}.scales"], tensors.get(f"{base}.biases"))
        out[_hf_name(base) + "." + kind] = w.astype(mx.float32)
    if config["model_type"] == "llama":
        hd = config["head_dim"]
        for i in range(config["num_hidden_layers"]):
            for p in ("q", "k"):
                key = f"model.layers.{i}.self_attn.{p}_proj.weight"
                if key in out:
                    out[key] = _unpermute(out[key], hd)
    return out


def _dequantize(w, scales, biases):
    # MLX hands GGUF's quantized blocks over as (weight, scales, biases) with
    # groups of 32; the bit width follows from the shapes.
    group = 32
    bits = w.shape[-1] * 32 // (scales.shape[-1] * group)
    if bits not in (2, 3, 4, 5, 6, 8):
        raise UnsupportedModelError(f"A GGUF tensor with {bits}-bit groups cannot be read.")
    # Scales arrive as float16; dequantize in float32 as llama.cpp does.
    f32 = lambda a: a.astype(mx.float32) if a is not None else None
    return mx.dequantize(w, f32(scales), f32(biases), group_size=group, bits=bits)


def _unpermute(w: mx.array, head_dim: int) -> mx.array:
    # llama.cpp stores each head's q/k rows as (pair, half); Hugging Face's
    # rotate-half layout wants (half, pair).
    rows, cols = w.shape
    w = w.reshape(rows // head_dim, head_dim // 2, 2, cols)
    return w.swapaxes(1, 2).reshape(rows, cols)


def _hf_name(base: str) -> str:
    if base in TOP:
        return TOP[base]
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in BLOCK:
        return f"model.layers.{parts[1]}.{BLOCK[parts[2]]}"
    raise UnsupportedModelError(f"Unexpected GGUF tensor '{base}': this model layout is not supported.")


def _tokenizer(meta: Dict, out: Path) -> None:
    """tokenizer.json and tokenizer_config.json from a byte-level BPE vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind, pre = _str(meta, "tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in PRE:
        raise UnsupportedModelError(
            f"GGUF tokenizer '{kind}' with pre-tokenizer '{pre}' is not supported "
            f"(supported: gpt2 byte-level BPE with {', '.join(PRE)})."
        )
    tokens = _str(meta, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _str(meta, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre == "llama-bpe"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in SPLITS)
    if pre in SPLITS:
        split = pre_tokenizers.Split(pre_tokenizers.Regex(SPLITS[pre]), "isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    elif pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    types = np.array(meta.get("tokenizer.ggml.token_type", mx.zeros((0,))))
    special = [tokens[i] for i in np.nonzero((types == 3) | (types == 4))[0]]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i.item())] if i is not None else None

    bos, eos = token("bos"), token("eos")
    add_bos = bool(meta["tokenizer.ggml.add_bos_token"].item()) if "tokenizer.ggml.add_bos_token" in meta else False
    if add_bos and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": add_bos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_num(meta, f"{meta['general.architecture']}.context_length", 4096)),
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}, indent=2) + "\n")
