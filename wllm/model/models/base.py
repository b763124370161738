"""What every wLLM model class shares: checkpoint loading by HF tensor names."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from wllm.model.config import ModelConfig
from wllm.model.layers.linear import MergedLinear, WeightShapeError, copy_into
from wllm.model.loader.errors import ModelLoadError

# (fused module name, HF module name, shard id): HF checkpoints store q/k/v and gate/up
# separately; we run them as one matmul each and load every part into its slice.
STACKED_QKV_GATE_UP: tuple[tuple[str, str, str], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", "gate"),
    ("gate_up_proj", "up_proj", "up"),
)


class WeightLoadError(ModelLoadError, ValueError):
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
            owner = self._merged_owner(name)
            try:
                if owner is not None:
                    owner.load_shard(param, tensor, shard)
                elif shard is None:
                    copy_into(param.data, tensor)
                else:
                    raise WeightShapeError(f"{name} is not a fused parameter but got part {shard!r}")
            except WeightShapeError as e:
                target = "" if name == hf_name else f" (parameter {name!r})"
                raise WeightLoadError(f"weight {hf_name!r}{target}: {e}") from None
            loaded.setdefault(name, set()).add(shard)
        missing = []
        for name in params:
            got = loaded.get(name)
            if not got:
                missing.append(name)
                continue
            owner = self._merged_owner(name)
            if None not in got and owner is not None:
                lacking = sorted(set(owner.shard_offsets) - got)
                if lacking:
                    missing.append(f"{name} (parts {', '.join(lacking)})")
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise WeightLoadError(f"checkpoint lacks {len(missing)} weight(s) of {type(self).__name__}: {shown}")

    def _merged_owner(self, param_name: str) -> MergedLinear | None:
        module = self.get_submodule(param_name.rpartition(".")[0])
        return module if isinstance(module, MergedLinear) else None

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [N, vocab] for hidden states [N, hidden_size], into `out` when given."""
        raise NotImplementedError(f"{type(self).__name__} has no language-model head")
