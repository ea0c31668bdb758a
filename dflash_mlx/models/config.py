"""DFlashConfig: read, derive and validate a draft's config.json (z-lab format)."""

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..errors import DraftConfigError


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> List[int]:
    """Target layers a draft reads when its config does not list them."""
    T, D = num_target_layers, num_draft_layers
    if D == 1:
        return [T // 2]
    return [round(1 + i * (T - 4) / (D - 1)) for i in range(D)]


_REQUIRED = {
    "hidden_size": int,
    "num_hidden_layers": int,
    "num_attention_heads": int,
    "num_key_value_heads": int,
    "intermediate_size": int,
    "vocab_size": int,
}
_OPTIONAL = {
    "head_dim": int,
    "rms_norm_eps": float,
    "rope_theta": float,
    "max_position_embeddings": int,
    "block_size": int,
    "num_target_layers": int,
    "sliding_window": int,
    "attention_bias": bool,
}


# Rope types mlx-lm's initialize_rope builds, with the keys each one reads.
ROPE_TYPES = {
    "default": (), "linear": ("factor",), "dynamic": ("factor",), "llama3": ("factor",),
    "yarn": ("factor",), "deepseek_yarn": ("factor",), "longrope": ("original_max_position_embeddings",
    "short_factor", "long_factor"), "proportional": (),
}


def _rope_type(d: Dict[str, Any]) -> str:
    return d.get("type") or d.get("rope_type") or "default"


DFLASH2 = "DFlash2DraftModel"


@dataclass
class DFlash2Params:
    """What a DFlash2 draft (``DFlash2DraftModel``) adds, from its dflash_config."""

    conv_group_size: int
    conv_kernel_size: int
    selector_rank: int
    selector_top_k: int
    final_logit_softcapping: Optional[float] = None
    output_multiplier: float = 1.0
    input_embedding_scale: float = 1.0

    @classmethod
    def from_dict(cls, d: Dict[str, Any], dc: Dict[str, Any], hidden: int, vocab: int) -> "DFlash2Params":
        if d.get("is_causal", False) is not False:
            raise DraftConfigError(
                "config.json: this DFlash2 draft asks for causal block attention (is_causal), "
                "which dflash_mlx does not implement; published DFlash2 drafts set is_causal false."
            )
        args = {}
        for f in fields(cls):
            v = dc.get(f.name, d.get(f.name))
            if v is None:
                if f.default is MISSING:
                    raise DraftConfigError(
                        f"config.json: a DFlash2 draft needs dflash_config.{f.name}; it is missing."
                    )
                continue
            kind = int if f.type is int else float
            args[f.name] = _typed(f"dflash_config.{f.name}", v, kind)
        p = cls(**args)
        if min(p.conv_group_size, p.conv_kernel_size, p.selector_rank, p.selector_top_k) < 1:
            raise DraftConfigError("config.json: DFlash2 conv and selector sizes must be positive.")
        if hidden % p.conv_group_size:
            raise DraftConfigError(
                f"config.json: hidden_size {hidden} is not a multiple of conv_group_size {p.conv_group_size}."
            )
        if p.selector_top_k > vocab:
            raise DraftConfigError(f"config.json: selector_top_k {p.selector_top_k} exceeds vocab_size {vocab}.")
        return p


@dataclass
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    mask_token_id: int
    target_layer_ids: List[int]
    num_target_layers: int
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    rope_scaling: Optional[Dict[str, Any]] = None
    max_position_embeddings: int = 40960
    block_size: int = 16
    attention_bias: bool = False
    layer_types: Optional[List[str]] = None
    sliding_window: Optional[int] = None
    draft_vocab: Optional[List[int]] = None  # the target token ids the draft proposes from
    dflash2: Optional[DFlash2Params] = None  # set for a DFlash2 draft
    dtype: Optional[str] = None  # the stored weights' type, as config.json names it
    extra: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "DFlashConfig":
        """Validate a parsed config.json and derive what it leaves out."""
        if not isinstance(d, dict):
            raise DraftConfigError("config.json must hold a JSON object.")
        if "speculators_model_type" in d:
            d = from_speculators(d)
        args = _plain_fields(d)
        dc = _dflash_config(d)
        args["mask_token_id"] = _mask_token_id(d, dc)
        args["target_layer_ids"], args["num_target_layers"] = _target_layers(
            d, dc, args["num_hidden_layers"], args.get("num_target_layers")
        )
        args["draft_vocab"] = _draft_vocab(dc, args["vocab_size"])
        args["block_size"] = _block_size(dc, args.get("block_size"))
        args["rope_theta"], args["rope_scaling"] = _rope(d, args.get("rope_theta"))
        _check_hidden_act(d)
        _check_rope_type(args["rope_scaling"])
        args["layer_types"] = _layer_types(d, args["num_hidden_layers"], args.get("sliding_window"))
        args["dtype"] = _dtype(d)
        args["dflash2"] = _dflash2(d, dc, args)
        known = {f.name for f in fields(cls)} | {"dflash_config", "torch_dtype", "is_causal", "architectures"}
        args["extra"] = {k: v for k, v in d.items() if k not in known}
        # None means not given: the field keeps its default.
        return cls(**{k: v for k, v in args.items() if v is not None})

    @classmethod
    def from_file(cls, path: Path) -> "DFlashConfig":
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            raise DraftConfigError(
                f"No config.json in {Path(path).parent}: a DFlash draft folder needs "
                "config.json and model.safetensors."
            ) from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise DraftConfigError(f"{path} is not valid JSON ({e}).") from None
        return cls.from_dict(d)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def to_dict(self) -> Dict[str, Any]:
        """The config.json of this draft, in the published z-lab layout."""
        d = {k: v for k, v in self.extra.items() if k != "speculators_model_type"}
        d.update(
            architectures=["DFlashDraftModel"],
            model_type=d.get("model_type", "qwen3"),
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            attention_bias=self.attention_bias,
            block_size=self.block_size,
            num_target_layers=self.num_target_layers,
            dflash_config={
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": self.target_layer_ids,
            },
        )
        if self.draft_vocab is not None:
            d["dflash_config"]["draft_vocab"] = self.draft_vocab
        if self.layer_types is not None:
            d["layer_types"] = self.layer_types
            d["sliding_window"] = self.sliding_window
        if self.dtype is not None:
            d["dtype"] = self.dtype
        if self.dflash2 is not None:
            d["architectures"], d["is_causal"] = [DFLASH2], False
            d["dflash_config"].update(asdict(self.dflash2), block_size=self.block_size)
        return d


# The steps of DFlashConfig.from_dict, in the order it checks them.

def _plain_fields(d: Dict[str, Any]) -> Dict[str, Any]:
    """The typed top-level fields given; the required ones must be positive."""
    args: Dict[str, Any] = {}
    for name, kind in {**_REQUIRED, **_OPTIONAL}.items():
        if name not in d or (d[name] is None and name not in _REQUIRED):
            if name in _REQUIRED:
                raise DraftConfigError(
                    f"config.json lacks '{name}'; a DFlash draft config needs "
                    f"{', '.join(_REQUIRED)}."
                )
            continue
        args[name] = _typed(name, d[name], kind)
    for name in _REQUIRED:
        if args[name] <= 0:
            raise DraftConfigError(f"config.json: '{name}' must be positive.")
    return args


def _dflash_config(d: Dict[str, Any]) -> Dict[str, Any]:
    dc = d.get("dflash_config") or {}
    if not isinstance(dc, dict):
        raise DraftConfigError("config.json: 'dflash_config' must be an object.")
    return dc


def _mask_token_id(d: Dict[str, Any], dc: Dict[str, Any]) -> int:
    mask = dc.get("mask_token_id", d.get("mask_token_id"))
    if mask is None:
        raise DraftConfigError(
            "config.json lacks dflash_config.mask_token_id; is this a DFlash draft?"
        )
    return _typed("dflash_config.mask_token_id", mask, int)


def _target_layers(
    d: Dict[str, Any], dc: Dict[str, Any], num_draft_layers: int, num_target_layers: Optional[int]
) -> Tuple[List[int], int]:
    """The target layers that feed the draft, and the target's layer count."""
    ids = dc.get("target_layer_ids", d.get("target_layer_ids"))
    if ids is None:
        if num_target_layers is None:
            raise DraftConfigError(
                "config.json gives neither dflash_config.target_layer_ids nor "
                "num_target_layers; one is needed to know which target layers "
                "feed the draft."
            )
        ids = default_layer_ids(num_target_layers, num_draft_layers)
    if not isinstance(ids, list) or not ids or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
    ):
        raise DraftConfigError(
            "config.json: target_layer_ids must be a non-empty list of "
            f"non-negative integers, got {ids!r}."
        )
    return list(ids), num_target_layers if num_target_layers is not None else max(ids) + 1


def _draft_vocab(dc: Dict[str, Any], vocab_size: int) -> Optional[List[int]]:
    vocab = dc.get("draft_vocab")
    if vocab is None:
        return None
    if not isinstance(vocab, list) or not vocab or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in vocab
    ) or len(set(vocab)) != len(vocab):
        raise DraftConfigError(
            f"config.json: dflash_config.draft_vocab must list distinct token ids below {vocab_size}."
        )
    return vocab


def _block_size(dc: Dict[str, Any], block_size: Optional[int]) -> Optional[int]:
    """The top-level block_size or the one DFlash2 configs keep in dflash_config."""
    nested = dc.get("block_size")
    if nested is not None:
        nested = _typed("dflash_config.block_size", nested, int)
        if block_size is not None and block_size != nested:
            raise DraftConfigError(
                f"config.json gives block_size {block_size} and dflash_config.block_size "
                f"{nested}; they must agree."
            )
        block_size = nested
    if block_size is not None and block_size < 1:
        raise DraftConfigError("config.json: 'block_size' must be at least 1.")
    return block_size


def _rope(
    d: Dict[str, Any], theta: Optional[float]
) -> Tuple[Optional[float], Optional[Dict[str, Any]]]:
    """rope_theta and rope_scaling, taking what rope_parameters adds."""
    rs = d.get("rope_scaling")
    if rs is not None and not isinstance(rs, dict):
        raise DraftConfigError("config.json: 'rope_scaling' must be null or an object.")
    rp = _rope_parameters(d)
    if rp is not None:
        if rp.get("rope_theta") is not None:
            nested = _typed("rope_parameters.rope_theta", rp["rope_theta"], float)
            if theta is not None and theta != nested:
                raise DraftConfigError(
                    f"config.json gives rope_theta {theta} and rope_parameters.rope_theta "
                    f"{nested}; they must agree."
                )
            theta = nested
        if rs is None and _rope_type(rp) != "default":
            rs = {k: v for k, v in rp.items() if k != "rope_theta"}
    for src in (d, rp or {}, rs or {}):
        if src.get("partial_rotary_factor", 1.0) != 1.0:
            raise DraftConfigError(
                f"config.json: partial_rotary_factor {src['partial_rotary_factor']} is not supported "
                "in drafts (their rope covers the whole head)."
            )
    return theta, rs


def _rope_parameters(d: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The rope settings transformers >= 5 nests in rope_parameters."""
    rp = d.get("rope_parameters")
    if rp is None:
        return None
    if not isinstance(rp, dict):
        raise DraftConfigError("config.json: 'rope_parameters' must be an object.")
    if any(isinstance(v, dict) for v in rp.values()):
        raise DraftConfigError(
            "config.json: rope_parameters per layer type (e.g. full_attention / sliding_attention) "
            "are not supported in drafts; give one rope_parameters object."
        )
    return rp


def _check_hidden_act(d: Dict[str, Any]) -> None:
    if d.get("hidden_act", "silu") != "silu":
        raise DraftConfigError(f"config.json: hidden_act {d['hidden_act']!r} is not supported; DFlash drafts use silu.")


def _check_rope_type(rs: Optional[Dict[str, Any]]) -> None:
    """That mlx-lm builds this rope scaling."""
    if rs is None:
        return
    kind = _rope_type(rs)
    if kind not in ROPE_TYPES:
        raise DraftConfigError(
            f"config.json: rope type '{kind}' is not supported (known: {', '.join(sorted(ROPE_TYPES))})."
        )
    missing = [k for k in ROPE_TYPES[kind] if k not in rs]
    if missing:
        raise DraftConfigError(f"config.json: a '{kind}' rope needs {', '.join(missing)}.")


def _layer_types(d: Dict[str, Any], num_layers: int, sliding_window: Optional[int]) -> Optional[List[str]]:
    lt = d.get("layer_types")
    if lt is None:
        return None
    if not isinstance(lt, list) or len(lt) != num_layers:
        raise DraftConfigError(
            f"config.json: 'layer_types' must list one type per draft layer ({num_layers})."
        )
    unknown = sorted({t for t in lt if t not in LAYER_TYPES}, key=str)
    if unknown:
        raise DraftConfigError(
            f"config.json: draft layer type {unknown[0]!r} is not supported "
            f"(known: {', '.join(LAYER_TYPES)})."
        )
    if "sliding_attention" in lt and not sliding_window:
        raise DraftConfigError(
            "config.json: sliding_attention layers need a positive 'sliding_window'."
        )
    return lt


def _dflash2(d: Dict[str, Any], dc: Dict[str, Any], args: Dict[str, Any]) -> Optional[DFlash2Params]:
    if DFLASH2 not in (d.get("architectures") or []):
        return None
    if args.get("draft_vocab"):
        raise DraftConfigError("config.json: a DFlash2 draft cannot have a draft_vocab.")
    return DFlash2Params.from_dict(d, dc, args["hidden_size"], args["vocab_size"])


SPECULATORS_LAYER = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "max_position_embeddings", "attention_bias", "layer_types", "sliding_window", "dtype", "torch_dtype",
)


def from_speculators(d: Dict[str, Any]) -> Dict[str, Any]:
    """The z-lab form of a speculators-format DFlash config (vllm-project/speculators:
    the layer shape under ``transformer_layer_config``, target layers as
    ``aux_hidden_state_layer_ids`` counted with the embedding output as 0, a
    draft vocabulary whose d2t/t2d maps sit in the weights)."""
    kind = d["speculators_model_type"]
    if kind != "dflash":
        raise DraftConfigError(
            f"config.json is a speculators '{kind}' checkpoint; dflash_mlx runs only speculators 'dflash' drafts."
        )
    tl = d.get("transformer_layer_config")
    if not isinstance(tl, dict):
        raise DraftConfigError("config.json: a speculators DFlash draft needs a 'transformer_layer_config' object.")
    ids, mask = d.get("aux_hidden_state_layer_ids"), d.get("mask_token_id")
    if mask is None:
        raise DraftConfigError("config.json: this speculators DFlash draft has no mask_token_id; it cannot draft.")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise DraftConfigError(
            "config.json: a speculators DFlash draft needs aux_hidden_state_layer_ids, a list of layer numbers."
        )
    if min(ids) < 1:
        raise DraftConfigError(
            "config.json: aux_hidden_state_layer_ids counts the embedding output as 0, and this draft reads it; "
            "dflash_mlx taps decoder layer outputs only (ids from 1)."
        )
    for key, ok, what in [
        ("projector_type", "dflash", "its projector"),
        ("sample_from_anchor", False, "drafting at the anchor position"),
    ]:
        if d.get(key, ok) != ok:
            raise DraftConfigError(f"config.json: {key} = {d[key]!r} ({what}) is not supported; dflash_mlx runs {key} {ok!r}.")
    out = {k: tl[k] for k in SPECULATORS_LAYER if tl.get(k) is not None}
    for k in ("layer_types", "sliding_window"):  # some exports keep these at the top
        if k not in out and d.get(k) is not None:
            out[k] = d[k]
    if "sliding_attention" in (out.get("layer_types") or []) and not d.get("sliding_window_non_causal", False):
        raise DraftConfigError(
            "config.json: this speculators draft's sliding layers are causal inside the block "
            "(sliding_window_non_causal false), which dflash_mlx does not implement."
        )
    hidden = d.get("target_hidden_size")
    if hidden is not None and hidden != out.get("hidden_size"):
        raise DraftConfigError(
            f"config.json: target_hidden_size {hidden} differs from the draft's hidden_size "
            f"{out.get('hidden_size')}; dflash_mlx needs them equal."
        )
    extra = {k: v for k, v in d.items() if k not in ("transformer_layer_config", "aux_hidden_state_layer_ids")}
    return {**extra, **out, "block_size": d.get("block_size", 8),
            "dflash_config": {"mask_token_id": mask, "target_layer_ids": [i - 1 for i in ids]}}


LAYER_TYPES = ("full_attention", "sliding_attention")
DTYPES = ("float32", "float16", "bfloat16")


def _dtype(d: Dict[str, Any]) -> Optional[str]:
    """The weights' type: ``dtype`` (transformers >= 5) or ``torch_dtype``."""
    names = {k: d[k] for k in ("dtype", "torch_dtype") if d.get(k) is not None}
    for k, v in names.items():
        if v not in DTYPES:
            raise DraftConfigError(f"config.json: '{k}' must be one of {', '.join(DTYPES)}, got {v!r}.")
    if len(set(names.values())) > 1:
        raise DraftConfigError(
            f"config.json gives dtype {names['dtype']!r} and torch_dtype {names['torch_dtype']!r}; "
            "they must agree."
        )
    return next(iter(names.values()), None)


def _typed(name: str, value: Any, kind: type) -> Any:
    ok = isinstance(value, kind) and not isinstance(value, bool) or (
        kind is bool and isinstance(value, bool)
    )
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise DraftConfigError(
            f"config.json: '{name}' must be {kind.__name__}, got {value!r}."
        )
    return value
