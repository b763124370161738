"""What every wLLM model class shares: checkpoint loading by HF tensor names."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from wllm.model.config import ModelConfig
from wllm.model.layers.linear import WeightShapeError, copy_into

# (fused module name, HF module name, shard id): HF checkpoints store q/k/v and gate/up
# separately; we run them as one matmul each and load every part into its slice.
STACKED_QKV_GATE_UP: tuple[tuple[str, str, str], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", "gate"),
    ("gate_up_proj", "up_proj", "up"),
)


class WeightLoadError(ValueError):
    """The checkpoint does not match the model: unexpected, missing or mis-shaped tensors."""


class ModelBase(nn.Module):
    """Base of all model classes: `load_weights` from (hf_name, tensor) pairs.

    Subclasses set `stacked_params` for fused layers and override `map_name` to rename or
    skip checkpoint tensors (return None to skip).
    """

    stacked_params: tuple[tuple[str, str, str], ...] = STACKED_QKV_GATE_UP
    # Substrings of checkpoint names that hold no weights we use (HF buffers).
    ignored_substrings: tuple[str, ...] = (
        "rotary_emb.inv_freq",
        "rotary_emb.cos_cached",
        "rotary_emb.sin_cached",
    )

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config

    def map_name(self, name: str) -> str | None:
        """Our parameter name for a checkpoint tensor name, or None to skip it."""
        return name

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy checkpoint tensors (dense or quantized) into the parameters, checking coverage.

        Raises WeightLoadError naming the tensor for an unexpected name or a shape mismatch,
        and listing every parameter the checkpoint did not provide.
        """
        params = dict(self.named_parameters())
        loaded: dict[str, set[str | None]] = {}
        for hf_name, tensor in weights:
            if any(s in hf_name for s in self.ignored_substrings):
                continue
            name = self.map_name(hf_name)
            if name is None:
                continue
            shard: str | None = None
            for fused, part, shard_id in self.stacked_params:
                if f".{part}." in name:
                    name = name.replace(f".{part}.", f".{fused}.")
                    shard = shard_id
                    break
            param = params.get(name)
            if param is None:
                raise WeightLoadError(
                    f"unexpected weight {hf_name!r} with shape {tuple(getattr(tensor, 'shape', ()))}: "
                    f"{type(self).__name__} has no parameter {name!r}"
                )
            loader = getattr(param, "weight_loader", None)
            try:
                if loader is None:
                    copy_into(param.data, tensor)
                else:
                    loader(param, tensor, shard)
            except WeightShapeError as e:
                raise WeightLoadError(f"weight {hf_name!r} (parameter {name!r}): {e}") from None
            loaded.setdefault(name, set()).add(shard)
        missing = []
        for name, param in params.items():
            got = loaded.get(name)
            if not got:
                missing.append(name)
                continue
            owner = getattr(getattr(param, "weight_loader", None), "__self__", None)
            if None not in got and owner is not None:
                lacking = sorted(set(owner.shard_offsets) - got)
                if lacking:
                    missing.append(f"{name} (parts {', '.join(lacking)})")
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise WeightLoadError(
                f"checkpoint lacks {len(missing)} weight(s) of {type(self).__name__}: {shown}"
            )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for hidden states [N, hidden_size]."""
        raise NotImplementedError(f"{type(self).__name__} has no language-model head")
