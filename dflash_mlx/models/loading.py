"""Load targets (through mlx-lm) and DFlash drafts (z-lab format), and check
that a draft fits its target."""

import glob
import json
import warnings
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from . import distributed
from .config import DFlashConfig
from ..engine.dflash2 import DFlash2Draft
from ..engine.draft import DFlashDraft
from ..errors import (
    DraftConfigError,
    DraftWeightsError,
    IncompatibleDraftError,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from ..engine.target import Target


def _on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def _local(path_or_repo: str, what: str) -> Optional[Path]:
    """The local folder, or None for something that looks like a hub id."""
    path = Path(path_or_repo).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelNotFoundError(f"{what} '{path}' is a file; give its folder.")
        return path
    if path_or_repo.count("/") != 1 or path_or_repo.startswith((".", "/", "~")):
        raise ModelNotFoundError(
            f"{what} '{path_or_repo}' is neither a local folder nor a hub repo id "
            "(owner/name)."
        )
    return None


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else 'no detail'}"


def _hub_error(what: str, repo: str, e: Exception) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"Could not fetch {what} '{repo}' from the hub ({_first_line(e)}). "
        "Check the repo id and your connection, or pass a local folder."
    )


def _load_error(e: Exception, path: Optional[Path], repo: str) -> Exception:
    """One clear error for whatever mlx_lm.load raised."""
    if path is None:
        return _hub_error("model", repo, e)
    if isinstance(e, json.JSONDecodeError):
        return ModelLoadError(f"{path}/config.json is not valid JSON ({e}).")
    if isinstance(e, ValueError) and "not supported" in str(e):
        return UnsupportedModelError(
            f"mlx-lm cannot build this model ({e}); check config.json's model_type "
            "or upgrade mlx-lm."
        )
    if isinstance(e, FileNotFoundError):
        return ModelNotFoundError(f"Incomplete model folder {path}: {e}")
    return ModelLoadError(
        f"Could not load the model in {path} ({_first_line(e)}); check that the "
        "folder is complete and its files are not corrupted."
    )


def model_folder(name: str):
    """The folder or hub id that ``name`` stands for: a named model and a
    .gguf file become their converted folder; anything else is unchanged."""
    from . import registry
    from .gguf import converted

    if registry.is_named(name):
        return registry.resolve(name)
    if str(name).lower().endswith(".gguf"):
        return converted(name)
    return name


def load(
    path_or_repo: str, dtype: Optional[mx.Dtype] = None, pipeline: bool = False
) -> Tuple[nn.Module, object]:
    """Load a target model and its tokenizer with ``mlx_lm.load``. Launched
    on several ranks (``mlx.launch``), each loads its shard of the target.

    Args:
        path_or_repo: A local Hugging Face folder, a hub repo id, a ``.gguf``
            file (converted once into a cached folder, see :mod:`dflash_mlx.models.gguf`)
            or a short name such as ``smollm2`` (see :mod:`dflash_mlx.models.registry`).
        dtype: Cast floating weights to this type. Default: float32 on the CPU
            (half-precision matmuls are slow there), unchanged on the GPU.
        pipeline: Under ``mlx.launch``, shard the target as a pipeline (each
            rank runs a slice of the layers) instead of tensor parallel.

    Returns:
        (model, tokenizer)
    """
    import mlx_lm

    path_or_repo = str(model_folder(path_or_repo))
    path = _local(path_or_repo, "Model")
    if path is not None and not (path / "config.json").exists():
        raise ModelNotFoundError(f"No config.json in {path}; is it a model folder?")
    group = distributed.group()
    try:
        if group is None:
            model, tokenizer = mlx_lm.load(str(path or path_or_repo))
        else:
            model, tokenizer = _sharded(str(path or path_or_repo), group, pipeline)
    except UnsupportedModelError:
        raise
    except Exception as e:
        raise _load_error(e, path, path_or_repo) from None
    dtype = dtype or (mx.float32 if _on_cpu() else None)
    if dtype is not None:
        model.set_dtype(dtype)
        # Cast now: a lazy cast belongs to this thread's stream, and MLX could
        # not evaluate it from another thread (a server's, a notebook's).
        mx.eval(model.parameters())
    return model, tokenizer


def _sharded(path_or_repo: str, group, pipeline: bool):
    """This rank's shard of the target, through mlx-lm's sharding."""
    from mlx_lm.utils import load_model, load_tokenizer, sharded_load

    path = Path(path_or_repo)
    if path.is_dir():  # a look at the classes, no weights read
        model, _ = load_model(path, lazy=True, strict=False)
        can_tp = hasattr(model, "shard")
        can_pp = hasattr(getattr(model, "model", None), "pipeline")
        if not (can_pp if pipeline else can_tp):
            ways = [w for w, ok in (("tensor parallel", can_tp), ("pipeline", can_pp)) if ok]
            raise UnsupportedModelError(
                f"mlx-lm cannot shard {type(model).__module__} "
                f"{'over a pipeline' if pipeline else 'tensor parallel'}"
                + (f"; it supports {ways[0]} only" if ways else "; it supports no sharding")
                + " (run it on one process, or use a model mlx-lm can shard)."
            )
        if not pipeline:
            _check_splits(path, group.size(), can_pp)
        if pipeline and not (path / "model.safetensors.index.json").exists():
            # sharded_load's pipeline path needs the index of a multi-file checkpoint.
            model.model.pipeline(group)
            mx.eval(model.parameters())
            mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))
            return model, load_tokenizer(path)
    kw = {"pipeline_group": group} if pipeline else {"tensor_group": group}
    try:
        return sharded_load(path_or_repo, **kw)
    except ValueError as e:
        if "does not support" in str(e):
            raise UnsupportedModelError(f"mlx-lm cannot shard this model ({e}).") from None
        raise


def _check_splits(path: Path, n: int, can_pp: bool) -> None:
    """Refuse a tensor-parallel split that mlx-lm would make unevenly (it
    divides head counts and widths by the ranks without checking, and the
    first forward fails deep in attention)."""
    config = json.loads((path / "config.json").read_text())
    config = {**config, **config.get("text_config", {})}
    sizes = {k: config.get(k) for k in ("num_attention_heads", "num_key_value_heads", "intermediate_size")}
    bad = {k: v for k, v in sizes.items() if isinstance(v, int) and v % n}
    if bad:
        ok = [r for r in range(2, 65) if all(v % r == 0 for v in sizes.values() if isinstance(v, int))]
        raise UnsupportedModelError(
            f"{path.name} cannot be split evenly over {n} ranks (tensor parallel): "
            + ", ".join(f"{k} = {v}" for k, v in bad.items())
            + ". Launch a number of ranks that divides it"
            + (f" ({', '.join(map(str, ok[:4]))})" if ok else "")
            + (", or shard it as a pipeline (--pipeline)." if can_pp else ", or run it on one process.")
        )


def load_draft(
    path_or_repo: str,
    dtype: Optional[mx.Dtype] = None,
    bits: Optional[int] = None,
    group_size: int = 64,
) -> DFlashDraft:
    """Load a DFlash draft in the published z-lab format, or one saved
    quantized by MLX (a ``quantization`` entry in config.json).

    Args:
        path_or_repo: A local folder with config.json and *.safetensors, or a
            hub repo id (only *.json and *.safetensors are downloaded).
        dtype: Weight type. Default: float32 on the CPU, else as stored.
        bits: Quantize the draft's linear layers to 8 or 4 bits at load
            (those whose input size ``group_size`` divides); the embedding and
            LM head are the target's and stay as they are.
        group_size: The quantization group size.
    """
    _check_quantization(bits, group_size)
    path = _draft_folder(path_or_repo)
    config = DFlashConfig.from_file(path / "config.json")
    draft = (DFlash2Draft if config.dflash2 else DFlashDraft)(config)
    stored = _stored_quantization(config, path)
    weights = _read_weights(path)
    if "speculators_model_type" in config.extra:
        _speculators_vocab(config, weights, path)
    if stored is not None:
        # The quantized structure first, so names and shapes can be checked.
        _quantize_as_stored(draft, stored, weights, path)
    _check_weights(draft, weights, stored, path)
    dtype = dtype or (mx.float32 if _on_cpu() else None)
    if dtype is not None:
        # Quantized weights are integers: only floats change type.
        weights = {
            k: w.astype(dtype) if mx.issubdtype(w.dtype, mx.floating) else w
            for k, w in weights.items()
        }
    draft.update(tree_unflatten(list(weights.items())))
    if bits is not None and stored is None:
        _quantize(draft, bits, group_size, lambda p, m: m.weight.shape[1] % group_size == 0)
    elif bits is not None and (bits, group_size) != (stored["bits"], stored["group_size"]):
        raise DraftConfigError(
            f"The draft in {path} is stored quantized ({stored['bits']} bits, group size "
            f"{stored['group_size']}); load it without bits, or from an unquantized copy."
        )
    mx.eval(draft.parameters())
    draft.eval()
    return draft


def _check_quantization(bits: Optional[int], group_size: int) -> None:
    """Refuse a ``bits`` or ``group_size`` that MLX cannot quantize with."""
    if bits is not None and (bits not in _BITS or isinstance(bits, bool)):
        raise DraftConfigError(f"Draft bits must be one of {', '.join(map(str, _BITS))}, got {bits!r}.")
    if not isinstance(group_size, int) or group_size not in _GROUPS:
        raise DraftConfigError(
            f"Draft group_size must be one of {', '.join(map(str, _GROUPS))}, got {group_size!r}."
        )


def _draft_folder(path_or_repo: str) -> Path:
    """The local folder of a draft, downloaded first for a hub id."""
    path = _local(path_or_repo, "Draft")
    if path is None:
        from huggingface_hub import snapshot_download

        try:
            path = Path(snapshot_download(path_or_repo, allow_patterns=["*.json", "*.safetensors"]))
        except Exception as e:  # network, auth, offline mode, unknown repo
            raise _hub_error("draft", path_or_repo, e) from None
    return path


def _read_weights(path: Path) -> dict:
    """All the draft's weights in ``path``, by name."""
    # model.safetensors or shards model-0000x-of-0000y.safetensors; other
    # safetensors files in the folder (e.g. a trainer's) are not weights.
    files = sorted(glob.glob(str(path / "model*.safetensors")))
    if not files:
        raise DraftWeightsError(f"No model*.safetensors file in {path}.")
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(f))
        except Exception as e:
            raise DraftWeightsError(
                f"{f} is not a readable safetensors file ({e}); download it again."
            ) from None
    return weights


def _quantize_as_stored(draft: DFlashDraft, stored: dict, weights: dict, path: Path) -> None:
    """Quantize the layers ``weights`` holds quantized, as config.json's
    ``stored`` entry says."""
    gs, b = stored["group_size"], stored["bits"]
    try:
        _quantize(draft, b, gs, lambda p, m: f"{p}.scales" in weights)
    except ValueError:  # a layer the group size does not divide
        raise DraftWeightsError(
            f"Draft weights in {path} do not fit its quantization entry (group_size "
            f"{gs}, bits {b}): some quantized layer's input size is not a multiple of {gs}."
        ) from None


def _check_weights(draft: DFlashDraft, weights: dict, stored: Optional[dict], path: Path) -> None:
    """Refuse ``weights`` whose names or shapes are not the draft's."""
    expected = dict(tree_flatten(draft.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {_few(missing)}")
        if unexpected:
            parts.append(f"unexpected {_few(unexpected)}")
        raise DraftWeightsError(
            f"Draft weights in {path} do not match its config.json: "
            + "; ".join(parts) + "."
        )
    for k, w in weights.items():
        if w.shape != expected[k].shape:
            hint = (
                f" (its quantization entry, group_size {stored['group_size']} and bits "
                f"{stored['bits']}, does not match the weights)"
                if stored is not None and k.endswith((".weight", ".scales", ".biases"))
                else ""
            )
            raise DraftWeightsError(
                f"Draft weight '{k}' has shape {tuple(w.shape)}, config.json implies "
                f"{tuple(expected[k].shape)}{hint}."
            )


def _speculators_vocab(config: DFlashConfig, weights: dict, path: Path) -> None:
    """Read a speculators draft's vocabulary maps out of its weights into
    ``config.draft_vocab``: t2d marks the target ids the draft proposes from,
    d2t holds each draft id's offset to its target id (target = draft + d2t).
    Its lm_head (a frozen copy of those rows of the target's head), and the
    target's embedding or final norm where an export kept them, are the
    target's own: the draft reads them from the target."""
    for k in ("lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight", "embed_tokens.weight"):
        weights.pop(k, None)
    d2t, t2d = weights.pop("d2t", None), weights.pop("t2d", None)
    V, n = config.vocab_size, config.extra.get("draft_vocab_size", config.vocab_size)
    if n == V and d2t is None and t2d is None:
        return
    if d2t is None or t2d is None:
        raise DraftWeightsError(
            f"The speculators draft in {path} has a {n}-token vocabulary but its weights lack "
            f"{'d2t' if d2t is None else 't2d'}; the maps to the target's vocabulary are needed."
        )
    ids = np.flatnonzero(np.array(t2d.astype(mx.bool_))) if t2d.shape == (V,) else None
    if ids is None or ids.size != n or d2t.shape != (n,):
        raise DraftWeightsError(
            f"The speculators draft in {path} has t2d {tuple(t2d.shape)} and d2t {tuple(d2t.shape)}; "
            f"draft_vocab_size {n} and vocab_size {V} need t2d ({V},) with {n} set and d2t ({n},)."
        )
    if not np.array_equal(np.arange(n) + np.array(d2t.astype(mx.int64)), ids):
        raise DraftWeightsError(f"The speculators draft in {path} has d2t and t2d that disagree.")
    config.draft_vocab = ids.tolist()


_BITS = (2, 3, 4, 5, 6, 8)
_GROUPS = (32, 64, 128)


def _stored_quantization(config: DFlashConfig, path: Path) -> Optional[dict]:
    """The ``quantization`` entry of an MLX-quantized draft's config.json."""
    q = config.extra.get("quantization")
    if q is None:
        return None
    ok = isinstance(q, dict) and all(
        isinstance(q.get(k), int) and not isinstance(q.get(k), bool) for k in ("group_size", "bits")
    )
    if not ok or q["bits"] not in _BITS or q["group_size"] not in _GROUPS:
        raise DraftConfigError(
            f"{path}/config.json: 'quantization' must be {{\"group_size\": 32|64|128, "
            f"\"bits\": 2..8}}, got {q!r}."
        )
    return q


def _quantize(draft: DFlashDraft, bits: int, group_size: int, which) -> None:
    """Quantize the draft's linear layers for which ``which(path, module)``
    holds, and record it in its config (so :func:`save_draft` keeps it)."""
    nn.quantize(
        draft, group_size, bits,
        class_predicate=lambda p, m: isinstance(m, nn.Linear) and which(p, m),
    )
    draft.config.extra["quantization"] = {"group_size": group_size, "bits": bits}


def save_draft(draft: DFlashDraft, path: str, dtype: mx.Dtype = mx.bfloat16) -> None:
    """Write ``draft`` as a z-lab-format folder (config.json, model.safetensors).
    Files are written under temporary names and renamed, so a failure leaves
    no half-written draft."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    weights = {
        k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in tree_flatten(draft.parameters())
    }
    tmp_w, tmp_c = out / ".model.tmp.safetensors", out / ".config.tmp.json"
    try:
        mx.save_safetensors(str(tmp_w), weights, metadata={"format": "mlx"})
        tmp_c.write_text(json.dumps(draft.config.to_dict(), indent=2) + "\n")
        tmp_w.rename(out / "model.safetensors")
        tmp_c.rename(out / "config.json")
    finally:
        for t in (tmp_w, tmp_c):
            t.unlink(missing_ok=True)


def check_compatible(draft: DFlashDraft, model: nn.Module) -> None:
    """Raise IncompatibleDraftError if ``draft`` cannot run on ``model``."""
    cfg, target = draft.config, Target(model)
    if cfg.hidden_size != target.hidden_size:
        raise IncompatibleDraftError(
            f"Draft hidden_size {cfg.hidden_size} != target hidden size "
            f"{target.hidden_size}: this draft was made for another target."
        )
    if cfg.vocab_size != target.vocab_rows:
        raise IncompatibleDraftError(
            f"Draft vocab_size {cfg.vocab_size} != target embedding rows "
            f"{target.vocab_rows}: the draft and target use different vocabularies."
        )
    bad = [i for i in cfg.target_layer_ids if i >= target.num_layers]
    if bad:
        raise IncompatibleDraftError(
            f"Draft reads target layers {bad}, but the target has only "
            f"{target.num_layers} layers: this draft was made for a deeper target."
        )
    if not 0 <= cfg.mask_token_id < target.vocab_rows:
        raise IncompatibleDraftError(
            f"Draft mask_token_id {cfg.mask_token_id} is outside the target's "
            f"embedding table ({target.vocab_rows} rows)."
        )
    if cfg.num_target_layers != target.num_layers and "speculators_model_type" not in cfg.extra:
        warnings.warn(
            f"Draft was trained for a {cfg.num_target_layers}-layer target; this "
            f"target has {target.num_layers}. Output stays exact, acceptance may drop.",
            stacklevel=2,
        )


def _few(names, n=4):
    more = f" (+{len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more
