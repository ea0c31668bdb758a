"""Tiny models of real mlx-lm architectures, saved as real Hugging Face folders.

Every folder holds config.json, model.safetensors, tokenizer.json and
tokenizer_config.json, and is loaded back through the project's real loaders.
"""

import json
import sysconfig
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, quantize_model

from dflash_mlx.models.config import DFlashConfig
from dflash_mlx.engine.draft import DFlashDraft
from dflash_mlx.engine.target import Target
from dflash_mlx.models.loading import save_draft

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HIDDEN = 64


def corpus_files(n: int = 12):
    lib = Path(sysconfig.get_paths()["stdlib"])
    return [str(p) for p in sorted(lib.glob("*.py"))[:n]]


_TRAINED = {}  # vocab_size -> (tokenizer.json text, its size): trained once per process


def write_tokenizer(folder: Path, vocab_size: int = 320) -> int:
    """Train a byte-level BPE on stdlib source; return its size.

    The training is deterministic, so it runs once per process and later
    folders get the same tokenizer.json (training took ~1 s of each build)."""
    if vocab_size not in _TRAINED:
        _TRAINED[vocab_size] = _train_tokenizer(vocab_size)
    text, size = _TRAINED[vocab_size]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(text)
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    return size


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train(corpus_files(), trainer)
    return tok.to_str(pretty=True), tok.get_vocab_size()


def target_config(arch: str, vocab: int, layers: int = 6, tied: bool = False) -> dict:
    base = dict(
        hidden_size=HIDDEN,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        vocab_size=vocab,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
    )
    if arch in ("qwen3", "qwen3_4bit"):
        return dict(base, model_type="qwen3")
    if arch == "llama":
        return dict(base, model_type="llama", tie_word_embeddings=True)
    if arch == "gpt_oss":  # sliding-window layers with a small window, MoE
        return dict(
            base,
            model_type="gpt_oss",
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        )
    if arch == "minimax":  # MiniMax-M2.5: MoE, partial rotary, per-layer q/k norms
        return dict(
            base,
            model_type="minimax_m2",
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=0,
            rotary_dim=8,
            use_qk_norm=True,
        )
    if arch == "gemma4":  # gemma-4-26B-A4B-like: sliding + global layers, MoE block, k = v globally
        text = dict(
            base,
            model_type="gemma4_text",
            global_head_dim=32,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * (layers // 3),
            num_kv_shared_layers=0,
            hidden_size_per_layer_input=0,
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=32,
            vocab_size_per_layer_input=vocab,
            final_logit_softcapping=30.0,
            rope_parameters={
                "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
                "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
            },
            tie_word_embeddings=True,
        )
        return {"model_type": "gemma4", "vocab_size": vocab, "text_config": text}
    if arch == "kimi_k25":  # DeepSeek-V3 layers: multi-head latent attention, routed + shared experts
        text = dict(
            base,
            model_type="kimi_k2",
            kv_lora_rank=16,
            q_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
        )
        return {"model_type": "kimi_k25", "text_config": text}
    linear = dict(
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        full_attention_interval=3,
        partial_rotary_factor=0.5,
    )
    if arch == "qwen3_5":
        text = dict(base, **linear, model_type="qwen3_5_text")
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        }
        return {"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": tied}
    if arch == "qwen3_5_moe":
        text = dict(
            target_config("qwen3_5", vocab, layers, tied)["text_config"],
            model_type="qwen3_5_moe_text",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        )
        return {"model_type": "qwen3_5_moe", "text_config": text, "tie_word_embeddings": tied}
    if arch == "qwen3_next":
        return dict(
            base,
            **linear,
            model_type="qwen3_next",
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        )
    raise ValueError(arch)


def make_target(
    folder: Path, arch: str, seed: int = 0, layers: int = 6, tied: bool = False, dtype=None, **overrides
) -> Path:
    """Write a random tiny target of ``arch`` to ``folder``.

    A ``tied`` target (embedding used as its head) tends to repeat its input
    token, which gives a draft something it can predict. ``dtype``: store the
    weights in it (e.g. mx.float16, as hub checkpoints are), with its
    ``torch_dtype`` in config.json."""
    n_tok = write_tokenizer(folder)
    vocab = n_tok + 16  # padded rows, like Qwen's embedding table
    config = {**target_config(arch, vocab, layers, tied or arch == "llama"), **overrides}
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    _scale_embedding(model)
    if tied:  # also archs without the tie option
        target = Target(model)
        if target._head_rows is not target.embed_tokens:
            target._head_rows.weight = target.embed_tokens.weight
    if arch.endswith("4bit"):
        model, config = quantize_model(model, config, group_size=32, bits=4)
    if dtype is not None:
        model.set_dtype(dtype)
        config["torch_dtype"] = str(dtype).split(".")[-1]
    mx.eval(model.parameters())
    mx.save_safetensors(
        str(folder / "model.safetensors"), dict(tree_flatten(model.parameters()))
    )
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _scale_embedding(model):
    # Unit-variance embeddings with an untied random head give nearly flat
    # logits; a larger head makes greedy choices clear-cut, as in real models.
    for name, m in model.named_modules():
        if name.endswith("lm_head") and isinstance(m, nn.Linear):
            m.weight = m.weight * 8.0


def make_draft(
    folder: Path,
    target_folder: Path,
    layers: int = 2,
    block_size: int = 16,
    seed: int = 1,
    with_layer_ids: bool = True,
    mask_token_id: int = None,
    echo: bool = False,
    **overrides,
) -> Path:
    """Write a random z-lab-format draft (bf16 weights) for the target.

    With ``echo`` every residual branch is zero, so the draft proposes
    head(norm(embed(mask_token_id))) at every offset: for a tied target that
    is the mask token itself, a real draft whose guesses are predictable."""
    tcfg = json.loads((target_folder / "config.json").read_text())
    text = tcfg.get("text_config", tcfg)
    T = text["num_hidden_layers"]
    d = dict(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        hidden_size=text["hidden_size"],
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        vocab_size=text["vocab_size"],
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=4096,
        attention_bias=False,
        block_size=block_size,
        num_target_layers=T,
        dflash_config={
            "mask_token_id": text["vocab_size"] - 16 if mask_token_id is None else mask_token_id
        },
    )
    if with_layer_ids:
        d["dflash_config"]["target_layer_ids"] = list(range(1, T, max(1, T // layers)))[:layers]
    d.update(overrides)
    mx.random.seed(seed)
    draft = DFlashDraft(DFlashConfig.from_dict(d))
    if echo:
        for layer in draft.layers:
            layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
            layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    mx.eval(draft.parameters())
    folder.mkdir(parents=True, exist_ok=True)
    save_draft(draft, str(folder))
    (folder / "config.json").write_text(json.dumps(d, indent=2))
    return folder
