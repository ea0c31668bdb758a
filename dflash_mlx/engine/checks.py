"""The checks of a generation's arguments, before anything runs."""

from typing import List, Optional, Union

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..errors import GenerationArgumentError
from .draft import DFlashDraft


def check_args(draft: Optional[DFlashDraft], block_size: Union[int, str, None], max_tokens: int,
               temperature: float, top_p: float, top_k: int, min_p: float,
               seed: Optional[int]) -> Union[int, str]:
    """The block size to decode with (``"auto"`` or an integer), once the
    arguments of :func:`.stream_generate` are checked."""
    trained = draft.block_size if draft is not None else 1
    if block_size is None or (isinstance(block_size, str) and block_size == "auto"):
        block_size = "auto" if trained > 1 else 1
    elif not isinstance(block_size, int) or block_size < 1:
        raise GenerationArgumentError(
            f"block_size must be a positive integer or 'auto', got {block_size!r}."
        )
    if draft is None and block_size > 1:
        raise GenerationArgumentError("block_size > 1 needs a draft; pass one, or block_size=1.")
    if block_size != "auto" and block_size > trained:
        raise GenerationArgumentError(
            f"block_size {block_size} is larger than the draft was trained for "
            f"({trained}); use {trained} or less."
        )
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise GenerationArgumentError(f"max_tokens must be a positive integer, got {max_tokens!r}.")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise GenerationArgumentError(f"temperature must be >= 0, got {temperature!r}.")
    if top_p and not 0 < top_p <= 1:
        raise GenerationArgumentError(f"top_p must be in (0, 1], got {top_p!r}.")
    if not isinstance(top_k, int) or top_k < 0:
        raise GenerationArgumentError(f"top_k must be a non-negative integer, got {top_k!r}.")
    if not 0 <= min_p <= 1:
        raise GenerationArgumentError(f"min_p must be in [0, 1], got {min_p!r}.")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise GenerationArgumentError(f"seed must be an integer, got {seed!r}.")
    return block_size


def check_variants(accept_threshold: Optional[float], denoise_steps: int, proposal: Optional[str],
                   sampler) -> None:
    """Check the arguments of :func:`.stream_generate` that change how it drafts."""
    if accept_threshold is not None and (
        isinstance(accept_threshold, bool)
        or not isinstance(accept_threshold, (int, float))
        or not 0 < accept_threshold <= 1
    ):
        raise GenerationArgumentError(
            f"accept_threshold must be in (0, 1] or None, got {accept_threshold!r}."
        )
    if isinstance(denoise_steps, bool) or not isinstance(denoise_steps, int) or denoise_steps < 1:
        raise GenerationArgumentError(f"denoise_steps must be a positive integer, got {denoise_steps!r}.")
    if proposal not in (None, "argmax", "sample"):
        raise GenerationArgumentError(f"proposal must be 'argmax', 'sample' or None, got {proposal!r}.")
    if proposal == "sample" and sampler is not None:
        raise GenerationArgumentError(
            "proposal='sample' needs the target's probabilities: use temperature/top_p/top_k/min_p, "
            "not a custom sampler."
        )


def prompt_ids(tokenizer: TokenizerWrapper, prompt) -> List[int]:
    """The prompt's token ids (text, ids or an ``mx.array`` of ids)."""
    if isinstance(prompt, str):
        if not prompt:
            raise GenerationArgumentError("The prompt is empty; give some text.")
        bos = tokenizer.bos_token
        ids = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    elif isinstance(prompt, mx.array):
        ids = prompt.reshape(-1).tolist()
    else:
        ids = list(prompt)
    if not ids:
        raise GenerationArgumentError("The prompt has no tokens; give some text.")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise GenerationArgumentError("A token prompt must hold integer ids only.")
    return ids


def check_vocab(ids: List[int], rows: int) -> None:
    """Check that the ids are rows of a vocabulary of ``rows``."""
    if min(ids) < 0 or max(ids) >= rows:
        raise GenerationArgumentError(f"The prompt holds token ids outside the model's vocabulary (0..{rows - 1}).")
