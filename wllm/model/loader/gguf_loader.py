"""Open a GGUF model (single file or split `name-0000i-of-0000N.gguf`) and yield HF-named weights.

`GGUFModel` exposes three things the model code needs: `metadata` (the GGUF key/values as plain
Python values), `hf_config` (the equivalent HF `config.json` dict) and `iter_weights()`, which
yields `(hf_param_name, tensor)` pairs with llama.cpp's storage conventions undone:

- llama: the Q/K rows that llama.cpp's converter permutes (for its rotary layout) are put back
  in HF order;
- gemma, gemma2: norm weights, which llama.cpp stores with +1 added, are returned without it;
- phi3: fused `qkv_proj` and `gate_up_proj` stay fused, as in HF Phi-3;
- config-only tensors (`rope_freqs`, phi3 rope factor tables) go into `hf_config`, not weights.

Files are memory-mapped copy-on-write: tensors returned without dequantization share pages with
the file until written to, so loading never holds two copies of the file in memory.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFValueType

from wllm.model.loader.dequant import (
    SUPPORTED_TYPES,
    GGMLType,
    float_dtype,
    is_float_type,
    supported_type_names,
)
from wllm.model.loader.errors import ModelLoadError
from wllm.model.loader.gguf_config import CONFIG_TENSORS, build_hf_config, supported_architectures
from wllm.model.loader.gguf_file import GGUFFormatError, GGUFHeader, GGUFTensorEntry, read_gguf_header
from wllm.model.loader.quantized import QuantizedTensor

__all__ = ["GGUFModel", "GGUFTensorInfo", "find_gguf_parts", "load_gguf"]

Weight = torch.Tensor | QuantizedTensor

_SPLIT_RE = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})(?P<ext>\.gguf)$", re.IGNORECASE)
_BLOCK_RE = re.compile(r"^blk\.(?P<bid>\d+)\.(?P<base>[a-z0-9_]+)\.(?P<kind>weight|bias)$")
_GLOBAL_RE = re.compile(r"^(?P<base>[a-z0-9_]+)\.(?P<kind>weight|bias)$")

_DECODER_GLOBALS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_DECODER_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Per architecture: (global GGUF base name -> HF name, per-block base -> HF name, block prefix).
_NAME_MAPS: dict[str, tuple[dict[str, str], dict[str, str], str]] = {
    "llama": (_DECODER_GLOBALS, _DECODER_BLOCK, "model.layers"),
    "qwen2": (_DECODER_GLOBALS, _DECODER_BLOCK, "model.layers"),
    "qwen3": (
        _DECODER_GLOBALS,
        {**_DECODER_BLOCK, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
        "model.layers",
    ),
    "gemma": (_DECODER_GLOBALS, _DECODER_BLOCK, "model.layers"),
    "gemma2": (
        _DECODER_GLOBALS,
        {
            **_DECODER_BLOCK,
            "ffn_norm": "pre_feedforward_layernorm",
            "post_attention_norm": "post_attention_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
        "model.layers",
    ),
    "phi3": (
        _DECODER_GLOBALS,
        {
            **{k: v for k, v in _DECODER_BLOCK.items() if k != "ffn_gate"},
            "attn_qkv": "self_attn.qkv_proj",
            "ffn_up": "mlp.gate_up_proj",  # gate and up fused, gate rows first, as in HF Phi-3
        },
        "model.layers",
    ),
    "bert": (
        {
            "token_embd": "embeddings.word_embeddings",
            "position_embd": "embeddings.position_embeddings",
            "token_types": "embeddings.token_type_embeddings",
            "token_embd_norm": "embeddings.LayerNorm",
        },
        {
            "attn_q": "attention.self.query",
            "attn_k": "attention.self.key",
            "attn_v": "attention.self.value",
            "attn_output": "attention.output.dense",
            "attn_output_norm": "attention.output.LayerNorm",
            "ffn_up": "intermediate.dense",
            "ffn_down": "output.dense",
            "layer_output_norm": "output.LayerNorm",
        },
        "encoder.layer",
    ),
}
# Tensors llama.cpp writes but no HF model has: skipped.
_IGNORED_BLOCK = {"attn_rot_embd"}
# Architectures whose converter permutes Q/K rows (llama.cpp's LlamaModel.permute).
_PERMUTED_QK = {"llama"}
# Architectures whose converter stores norm weights as (1 + w).
_NORM_PLUS_ONE = {"gemma", "gemma2"}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of a GGUF file: GGUF name, GGML type, HF-order shape, and its raw bytes."""

    name: str
    ggml_type: GGMLType
    shape: tuple[int, ...]
    part: Path
    raw: np.ndarray  # uint8 view of the memory-mapped file

    @property
    def nbytes(self) -> int:
        """Bytes the tensor takes in the file."""
        return int(self.raw.nbytes)


def find_gguf_parts(path: str | os.PathLike[str]) -> list[Path]:
    """All files of the GGUF at `path`, in order.

    `path` may be a single GGUF, any part of a split GGUF (`name-00002-of-00005.gguf`), or a folder
    holding exactly one of either. Raises ModelLoadError if a part is missing.
    """
    p = Path(path)
    if p.is_dir():
        candidates = sorted(
            q
            for q in p.iterdir()
            if q.suffix.lower() == ".gguf" and ((m := _SPLIT_RE.match(q.name)) is None or int(m["no"]) == 1)
        )
        if len(candidates) != 1:
            found = ", ".join(q.name for q in candidates) or "none"
            raise ModelLoadError(
                f"{p}: expected exactly one GGUF model (single file or split set) in the folder, found: {found}"
            )
        p = candidates[0]
    m = _SPLIT_RE.match(p.name)
    if m is None:
        if not p.is_file():
            raise ModelLoadError(f"{p}: no such GGUF file")
        return [p]
    count = int(m["count"])
    if count < 1 or int(m["no"]) < 1 or int(m["no"]) > count:
        raise ModelLoadError(f"{p}: split GGUF name has an invalid part number (want 00001..{count:05d})")
    parts = [p.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}{m['ext']}") for i in range(1, count + 1)]
    missing = [q.name for q in parts if not q.is_file()]
    if missing:
        raise ModelLoadError(
            f"{p}: split GGUF is missing {len(missing)} of {count} parts: {', '.join(missing)} "
            f"(all parts must be in {p.parent})"
        )
    return parts


def _corrupt(path: Path, why: str) -> ModelLoadError:
    return ModelLoadError(
        f"{path}: {why}. wLLM reads GGUF v2/v3 files of architectures {supported_architectures()} "
        f"with tensor types {supported_type_names()}"
    )


def _open_part(path: Path) -> tuple[GGUFHeader, np.memmap]:
    """Parse a part's header (cached per process) and memory-map it copy-on-write."""
    try:
        header = read_gguf_header(path)
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read GGUF file: {exc}") from exc
    except GGUFFormatError as exc:
        raise _corrupt(path, str(exc)) from exc
    size = header.file_size
    for t in header.tensors:
        end = t.offset + t.n_bytes
        if end > size:
            raise _corrupt(path, f"truncated GGUF file: tensor {t.name} ends at byte {end}, file has {size}")
    try:
        # Copy-on-write: tensors built on the map are writable, and writes never reach the file.
        data = np.memmap(path, dtype=np.uint8, mode="c")
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot map GGUF file: {exc}") from exc
    return header, data


def _field_value(header: GGUFHeader, key: str) -> Any:
    vtype = header.fields[key][0]
    value = header.value(key)
    if vtype == GGUFValueType.FLOAT32:
        # Shortest decimal that round-trips the float32 (1e-05, not 9.999999747378752e-06).
        value = float(str(np.float32(value)))
    elif vtype == GGUFValueType.ARRAY and value and isinstance(value[0], list):
        # Nested arrays flattened, as gguf.GGUFReader's contents() returns them.
        value = _flatten(value)
    return value


def _flatten(values: list[Any]) -> list[Any]:
    out: list[Any] = []
    for v in values:
        out.extend(_flatten(v) if isinstance(v, list) else [v])
    return out


class GGUFModel:
    """A GGUF model file (or split set), memory-mapped, with HF-shaped config and weight names.

    Use `load_gguf(path)` or `GGUFModel(path)`; close with `close()` or a `with` block.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.paths: list[Path] = find_gguf_parts(path)
        self.path: Path = self.paths[0]
        opened = [_open_part(p) for p in self.paths]
        self._headers: list[GGUFHeader] = [h for h, _ in opened]
        self._maps: list[np.memmap] = [m for _, m in opened]
        first = self._headers[0]
        self.metadata: dict[str, Any] = {k: _field_value(first, k) for k in first.fields}
        self._check_split()
        self.architecture: str = str(self.metadata.get("general.architecture", ""))
        if self.architecture not in _NAME_MAPS:
            raise ModelLoadError(
                f"{self.path}: GGUF architecture {self.architecture!r} is not supported; "
                f"supported: {supported_architectures()}"
            )
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for part, header, data in zip(self.paths, self._headers, self._maps):
            for t in header.tensors:
                self._add_tensor(part, t, data)
        shapes = {name: info.shape for name, info in self.tensors.items()}
        self.hf_config: dict[str, Any] = build_hf_config(
            str(self.path), self.metadata, shapes, lambda n: self._read(self.tensors[n], torch.float32, None)
        )
        self._hf_names: dict[str, str] = {name: hf for name in self.tensors if (hf := self._hf_name(name)) is not None}

    # ---- opening -------------------------------------------------------------------------------

    def _check_split(self) -> None:
        count = len(self.paths)
        declared = int(self.metadata.get("split.count", 1) or 1)
        if declared != count:
            if count == 1:
                raise ModelLoadError(
                    f"{self.path}: this is one part of a {declared}-part split GGUF, but its name does not "
                    f"follow NAME-00001-of-{declared:05d}.gguf, so the other parts cannot be found"
                )
            raise ModelLoadError(f"{self.path}: file names say {count} parts but split.count is {declared}")
        total = 0
        for i, (p, h) in enumerate(zip(self.paths, self._headers)):
            no = h.value("split.no")
            if count > 1 and (no is None or int(no) != i):
                raise ModelLoadError(f"{p}: expected split.no = {i} in part {i + 1} of {count}, found {no}")
            total += len(h.tensors)
        declared_tensors = self.metadata.get("split.tensors.count")
        if count > 1 and declared_tensors is not None and int(declared_tensors) != total:
            raise ModelLoadError(
                f"{self.path}: split GGUF declares {declared_tensors} tensors but its {count} parts hold {total}"
            )

    def _add_tensor(self, part: Path, t: GGUFTensorEntry, data: np.memmap) -> None:
        if t.name in self.tensors:
            raise ModelLoadError(f"{part}: tensor {t.name} appears in more than one part")
        if t.ggml_type not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{part}: tensor {t.name} has GGML type {t.ggml_type.name}, which wLLM cannot dequantize; "
                f"supported types: {supported_type_names()}"
            )
        shape = tuple(reversed(t.dims))
        raw = np.asarray(data[t.offset : t.offset + t.n_bytes])
        self.tensors[t.name] = GGUFTensorInfo(t.name, t.ggml_type, shape, part, raw)

    def _hf_name(self, name: str) -> str | None:
        globals_, block, prefix = _NAME_MAPS[self.architecture]
        if name in CONFIG_TENSORS:
            return None
        if m := _BLOCK_RE.match(name):
            bid, base = int(m["bid"]), m["base"]
            if base in _IGNORED_BLOCK:
                return None
            if base in block and bid < self.hf_config["num_hidden_layers"]:
                return f"{prefix}.{bid}.{block[base]}.{m['kind']}"
        elif (m := _GLOBAL_RE.match(name)) and m["base"] in globals_:
            return f"{globals_[m['base']]}.{m['kind']}"
        raise ModelLoadError(
            f"{self.tensors[name].part}: tensor {name!r} is not part of a {self.architecture} model that wLLM "
            f"supports (mixture-of-experts, multimodal and classifier tensors are not supported)"
        )

    def close(self) -> None:
        """Drop the file maps (tensors already handed out keep their own reference)."""
        self._headers.clear()
        self._maps.clear()
        self.tensors.clear()
        self._hf_names.clear()

    def __enter__(self) -> GGUFModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFModel({self.path.name!r}, arch={self.architecture}, tensors={len(self.tensors)})"

    # ---- weights -------------------------------------------------------------------------------

    def weight_names(self) -> list[str]:
        """HF parameter names `iter_weights` yields, in the same order."""
        names = list(self._hf_names.values())
        if self.architecture == "phi3":
            names = _fused_phi3_names(names)
        return names

    def iter_weights(
        self, dequantize: bool | torch.dtype = False, device: torch.device | str | None = None
    ) -> Iterator[tuple[str, Weight]]:
        """Yield `(hf_param_name, weight)` for every weight, in file order.

        dequantize=False: quantized tensors come as `QuantizedTensor` (raw blocks, HF shape);
        F32/F16/BF16 tensors as plain tensors of that dtype. dequantize=True: everything as
        float32 tensors; a torch dtype: everything dequantized (in float32) then cast to it.
        `device`: where tensors (or the raw bytes of QuantizedTensors) are put; dequantization
        runs there. Gemma norm weights are float32 unless a dtype was asked for.
        """
        if dequantize is True:
            out_dtype: torch.dtype | None = torch.float32
        elif dequantize is False:
            out_dtype = None
        elif isinstance(dequantize, torch.dtype):
            out_dtype = dequantize
        else:
            raise TypeError(f"dequantize must be a bool or a torch.dtype, got {dequantize!r}")
        pending: dict[str, dict[str, Weight]] = {}
        for gguf_name, hf_name in list(self._hf_names.items()):
            info = self.tensors[gguf_name]
            # Row permutes and fusions act on the raw blocks (a quarter of the bytes of float32
            # values); dequantization comes last.
            value = self._transform(info, self._read(info, None, device), out_dtype)
            if self.architecture == "phi3" and (fused := _phi3_qkv_part(hf_name)) is not None:
                # A phi3 GGUF with separate q/k/v: fuse them into HF's qkv_proj.
                target, which = fused
                parts = pending.setdefault(target, {})
                parts[which] = value
                if len(parts) == 3:
                    del pending[target]
                    yield target, _dense(_cat_rows([parts["q"], parts["k"], parts["v"]], out_dtype), out_dtype)
                continue
            yield hf_name, _dense(value, out_dtype)
        if pending:
            raise ModelLoadError(f"{self.path}: incomplete q/k/v tensors for {sorted(pending)}")

    def _read(self, info: GGUFTensorInfo, out_dtype: torch.dtype | None, device: Any) -> Weight:
        raw = torch.from_numpy(info.raw)
        if device is not None:
            raw = raw.to(device)
        if is_float_type(info.ggml_type):
            value = raw.view(float_dtype(info.ggml_type)).reshape(info.shape)
            if out_dtype is not None:
                # F16/BF16 -> float32 is exact; cast to the asked dtype from there, like the quant path.
                value = value.to(torch.float32).to(out_dtype)
            return value
        qt = QuantizedTensor(raw, info.ggml_type, info.shape)
        return qt if out_dtype is None else qt.dequantize(out_dtype)

    def _transform(self, info: GGUFTensorInfo, value: Weight, out_dtype: torch.dtype | None) -> Weight:
        base = info.name.rsplit(".", 1)[0]
        if self.architecture in _PERMUTED_QK and base.endswith((".attn_q", ".attn_k")):
            cfg = self.hf_config
            heads = cfg["num_attention_heads"] if base.endswith(".attn_q") else cfg["num_key_value_heads"]
            idx = _unpermute_index(info.shape[0], heads, info.name)
            if isinstance(value, QuantizedTensor):
                return value.index_rows(idx)
            return value.index_select(0, idx.to(value.device))
        if self.architecture in _NORM_PLUS_ONE and info.name.endswith("norm.weight"):
            dense = value.dequantize() if isinstance(value, QuantizedTensor) else value.to(torch.float32)
            return (dense - 1.0).to(out_dtype or torch.float32)
        return value


def _unpermute_index(rows: int, heads: int, name: str) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permute for `heads` heads.

    llama.cpp stores, per head, the rotary pairs interleaved (row 2i+j is HF row j*D/2 + i); HF
    keeps each head's first half then second half. So HF row h*D + j*D/2 + i = GGUF h*D + 2i + j.
    """
    if heads <= 0 or rows % (2 * heads) != 0:
        raise ModelLoadError(f"tensor {name}: {rows} rows cannot be split into {heads} heads of even size")
    half = rows // heads // 2
    h = torch.arange(heads).view(heads, 1, 1)
    j = torch.arange(2).view(1, 2, 1)
    i = torch.arange(half).view(1, 1, half)
    return (h * 2 * half + 2 * i + j).reshape(-1)


def _phi3_qkv_part(hf_name: str) -> tuple[str, str] | None:
    for which in ("q", "k", "v"):
        suffix = f".self_attn.{which}_proj."
        if suffix in hf_name:
            return hf_name.replace(suffix, ".self_attn.qkv_proj."), which
    return None


def _fused_phi3_names(names: list[str]) -> list[str]:
    out: list[str] = []
    seen: dict[str, int] = {}
    for name in names:
        fused = _phi3_qkv_part(name)
        if fused is None:
            out.append(name)
            continue
        seen[fused[0]] = seen.get(fused[0], 0) + 1
        if seen[fused[0]] == 3:
            out.append(fused[0])
    return out


def _dense(value: Weight, out_dtype: torch.dtype | None) -> Weight:
    """`value` as a dense `out_dtype` tensor (values computed in float32); unchanged when None."""
    if out_dtype is None:
        return value
    if isinstance(value, QuantizedTensor):
        return value.dequantize(out_dtype)
    # F16/BF16 -> float32 is exact; cast to the asked dtype from there, like the quant path.
    return value.to(torch.float32).to(out_dtype)


def _cat_rows(parts: list[Weight], out_dtype: torch.dtype | None) -> Weight:
    if all(isinstance(p, QuantizedTensor) for p in parts):
        qparts = [p for p in parts if isinstance(p, QuantizedTensor)]
        if len({p.ggml_type for p in qparts}) == 1:
            return QuantizedTensor.cat(qparts)
    # Mixed storage types cannot share one block layout: fall back to dense values.
    dense = [p.dequantize() if isinstance(p, QuantizedTensor) else p.to(torch.float32) for p in parts]
    return torch.cat(dense, dim=0).to(out_dtype or torch.float32)


def load_gguf(path: str | os.PathLike[str]) -> GGUFModel:
    """Open a GGUF model (file, any part of a split set, or a folder holding one)."""
    return GGUFModel(path)
