"""`ModelConfig`: one normalised view of an HF `config.json` (or a GGUF's equivalent dict).

Architectures spell the same idea differently (`rope_theta` vs `rope_parameters`, `hidden_act`
vs `hidden_activation`, Gemma 2's implicit alternating sliding window, Qwen2's
`use_sliding_window`); this module resolves all of that once so model code reads plain fields.
The raw dict is kept in `raw` for anything architecture-specific that is not normalised here.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import torch

# Rope scaling types we implement; each maps to a static frequency table (see layers/rotary.py).
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")

_DTYPE_NAMES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

_ROPE_THETA_DEFAULT = 10000.0
# Families whose HF config class ties the LM head to the embedding unless told otherwise.
_TIED_BY_DEFAULT = frozenset({"gemma", "gemma2", "bert"})


class ConfigError(ValueError):
    """The model config is missing a required field or uses something we do not support."""


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """Map a dtype name ("bfloat16", "torch.float16", ...) or a torch.dtype to a torch.dtype."""
    if value is None or isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.").lower()
    if name not in _DTYPE_NAMES:
        raise ConfigError(f"unsupported dtype {value!r}; supported: float32, float16, bfloat16")
    return _DTYPE_NAMES[name]


class ModelConfig(msgspec.Struct, kw_only=True):
    """Architecture hyper-parameters, normalised across model families."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    norm_eps: float = 1e-6
    rope_theta: float = _ROPE_THETA_DEFAULT
    # Normalised rope scaling dict with a "rope_type" key, or None for plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    # Per-frequency divisors (llama.cpp's `rope_freqs` tensor in GGUF files of Llama 3.1).
    rope_freq_factors: list[float] | None = None
    partial_rotary_factor: float = 1.0
    sliding_window: int | None = None
    # Window per layer (None = full attention), length num_hidden_layers.
    layer_sliding_windows: list[int | None] = msgspec.field(default_factory=list)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    torch_dtype: str | None = None
    # Encoder-only (BERT) fields.
    type_vocab_size: int = 0
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    raw: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def rotary_dim(self) -> int:
        """Number of leading head dims that RoPE rotates (even)."""
        dim = int(self.head_dim * self.partial_rotary_factor)
        return dim - dim % 2

    @property
    def attention_scale(self) -> float:
        """Softmax scale: 1/sqrt(query_pre_attn_scalar) for Gemma 2, else 1/sqrt(head_dim)."""
        if self.query_pre_attn_scalar is not None:
            return float(self.query_pre_attn_scalar) ** -0.5
        return self.head_dim**-0.5

    @property
    def dtype(self) -> torch.dtype | None:
        """The checkpoint's declared dtype (None when not stated)."""
        return parse_dtype(self.torch_dtype) if self.torch_dtype else None

    @classmethod
    def from_hf(cls, hf: dict[str, Any], architecture: str | None = None) -> ModelConfig:
        """Build from an HF config.json dict; `architecture` overrides `architectures[0]`."""
        if not isinstance(hf, dict):
            raise ConfigError(f"model config must be a dict, got {type(hf).__name__}")
        arch = architecture or _first_architecture(hf)
        model_type = str(hf.get("model_type", "")).lower()

        def need(key: str) -> Any:
            if hf.get(key) is None:
                raise ConfigError(f"model config for {arch} lacks required field {key!r}")
            return hf[key]

        hidden = int(need("hidden_size"))
        n_heads = int(need("num_attention_heads"))
        n_layers = int(need("num_hidden_layers"))
        n_kv = int(hf.get("num_key_value_heads") or n_heads)
        head_dim = int(hf.get("head_dim") or hidden // n_heads)
        if n_heads % n_kv:
            raise ConfigError(f"num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}")

        rope_params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
        rope_theta = float(hf.get("rope_theta") or rope_params.get("rope_theta") or _ROPE_THETA_DEFAULT)
        partial = hf.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0))
        rope_scaling = _normalise_rope_scaling(hf.get("rope_scaling") or rope_params, arch)

        sliding = hf.get("sliding_window")
        if model_type == "qwen2" or model_type == "qwen3":
            # Qwen declares a window but only uses it when use_sliding_window is set.
            if not hf.get("use_sliding_window", False):
                sliding = None
        sliding = int(sliding) if sliding else None
        layer_windows = _layer_windows(hf, model_type, n_layers, sliding)

        act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
        if model_type == "gemma" and act == "gelu":
            # Gemma 1 configs say "gelu" but the model was trained with the tanh approximation
            # (HF overrides it the same way).
            act = "gelu_pytorch_tanh"

        eos = hf.get("eos_token_id")
        eos_ids = [int(e) for e in eos] if isinstance(eos, list) else ([int(eos)] if eos is not None else [])
        tie = hf.get("tie_word_embeddings")
        if tie is None:
            # Absent from config.json: use the HF config class's default for the family.
            tie = model_type in _TIED_BY_DEFAULT
        dtype = hf.get("torch_dtype") or hf.get("dtype")

        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            hidden_act=str(act),
            max_position_embeddings=int(hf.get("max_position_embeddings") or 2048),
            norm_eps=float(hf.get("rms_norm_eps") or hf.get("layer_norm_eps") or 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rope_freq_factors=[float(f) for f in hf["rope_freq_factors"]] if hf.get("rope_freq_factors") else None,
            partial_rotary_factor=float(partial if partial is not None else 1.0),
            sliding_window=sliding,
            layer_sliding_windows=layer_windows,
            attn_logit_softcapping=_opt_float(hf.get("attn_logit_softcapping")),
            final_logit_softcapping=_opt_float(hf.get("final_logit_softcapping")),
            query_pre_attn_scalar=_opt_float(hf.get("query_pre_attn_scalar")),
            tie_word_embeddings=bool(tie),
            attention_bias=bool(hf.get("attention_bias", hf.get("qkv_bias", model_type == "qwen2"))),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            torch_dtype=str(dtype).removeprefix("torch.") if dtype else None,
            type_vocab_size=int(hf.get("type_vocab_size") or 0),
            pad_token_id=hf.get("pad_token_id") if isinstance(hf.get("pad_token_id"), int) else None,
            bos_token_id=hf.get("bos_token_id") if isinstance(hf.get("bos_token_id"), int) else None,
            eos_token_ids=eos_ids,
            raw=dict(hf),
        )


def _first_architecture(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures")
    if isinstance(archs, list) and archs:
        return str(archs[0])
    if isinstance(archs, str) and archs:
        return archs
    raise ConfigError("model config has no 'architectures' entry; cannot tell which model class to use")


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _normalise_rope_scaling(scaling: dict[str, Any] | None, arch: str) -> dict[str, Any] | None:
    """Return a copy with a 'rope_type' key, or None for plain RoPE; reject types we lack."""
    if not scaling:
        return None
    out = dict(scaling)
    rope_type = str(out.pop("type", None) or out.get("rope_type") or "default").lower()
    out["rope_type"] = rope_type
    out.pop("rope_theta", None)
    out.pop("partial_rotary_factor", None)
    if rope_type == "default":
        return None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{arch}: rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type in ("linear", "dynamic", "llama3", "yarn") and "factor" not in out:
        raise ConfigError(f"{arch}: rope scaling {rope_type!r} needs a 'factor'")
    return out


def _layer_windows(hf: dict[str, Any], model_type: str, n_layers: int, window: int | None) -> list[int | None]:
    if window is None:
        return [None] * n_layers
    layer_types = hf.get("layer_types")
    if isinstance(layer_types, list) and len(layer_types) == n_layers:
        return [window if t == "sliding_attention" else None for t in layer_types]
    if model_type == "gemma2":
        # Gemma 2 alternates: even layers (0, 2, ...) use the window, odd ones see everything.
        return [window if i % 2 == 0 else None for i in range(n_layers)]
    if model_type in ("qwen2", "qwen3"):
        start = int(hf.get("max_window_layers", 0) or 0)
        return [window if i >= start else None for i in range(n_layers)]
    return [window] * n_layers


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (fp32, [rotary_dim // 2]) including any static rope scaling.

    Returns (inv_freq); the cos/sin multiplier ("attention factor", used by YaRN) is
    `rope_attention_factor(config)`.
    """
    dim = config.rotary_dim
    base = config.rope_theta
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "dynamic":
        # Static NTK: the base is stretched once as if every sequence had the longest supported
        # length (max_position_embeddings * factor), as vLLM does. HF instead re-stretches per
        # sequence (plain RoPE up to the original length), which a paged KV cache cannot do.
        factor = float(scaling["factor"])
        base = base * (factor * factor - (factor - 1)) ** (dim / (dim - 2))
    # float32 throughout, the way HF computes it, so angles match the reference bit for bit.
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3" and config.rope_freq_factors is None:
        # GGUF files carry the same Llama 3.1 scaling as a factor table (applied below) instead.
        inv_freq = _llama3_scale(inv_freq, scaling)
    elif rope_type == "yarn":
        inv_freq = _yarn_inv_freq(inv_freq, dim, base, scaling, config.max_position_embeddings)
    if config.rope_freq_factors is not None:
        factors = torch.tensor(config.rope_freq_factors, dtype=torch.float32)
        if factors.numel() != inv_freq.numel():
            raise ConfigError(
                f"rope_freq_factors has {factors.numel()} entries, expected rotary_dim/2 = {inv_freq.numel()}"
            )
        inv_freq = inv_freq / factors
    return inv_freq


def rope_attention_factor(config: ModelConfig) -> float:
    """Multiplier applied to cos and sin (1.0 except for YaRN)."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m: float) -> float:
        return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return mscale(1.0)


def _llama3_scale(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend smoothly between.
    factor = float(s["factor"])
    low = float(s.get("low_freq_factor", 1.0))
    high = float(s.get("high_freq_factor", 4.0))
    orig = float(s.get("original_max_position_embeddings", 8192))
    low_wavelen = orig / low
    high_wavelen = orig / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, base: float, s: dict[str, Any], max_pos: int) -> torch.Tensor:
    factor = float(s["factor"])
    orig = float(s.get("original_max_position_embeddings") or max_pos)
    beta_fast = float(s.get("beta_fast") or 32)
    beta_slow = float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = correction_dim(beta_fast)
    high = correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
