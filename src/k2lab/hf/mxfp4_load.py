"""Loading MXFP4 weights: which ``<module>.weight_packed`` / ``<module>.weight_scale`` pairs on disk stand for
which expected ``<module>.weight`` [out, in], and their dequantisation as they are read (``k2lab.hf.mxfp4``).

``from_hf`` plans a load by matching disk keys to the tensors the model expects; with a config that declares
MXFP4 (``k2lab.hf.mxfp4.declared_mxfp4``) an expected ``X.weight`` [..., out, in] is also satisfied by
``X.weight_packed`` uint8 [..., out, in/2] + ``X.weight_scale`` uint8 [..., out, in/32]. Mis-shaped or
half-present pairs are reported with the loader's other mismatches.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from k2lab.hf.mxfp4 import GROUP_SIZE, PACKED_SUFFIX, SCALE_SUFFIX, dequantize_mxfp4, packed_shapes

__all__ = ["PackedPair", "PackedMatch", "match_packed", "with_packed_weights"]


class _Header(Protocol):
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name


@dataclass(frozen=True)
class PackedPair:
    """The scale tensor that goes with one ``weight_packed`` tensor, and where it is."""

    scale_key: str
    scale_file: Path

    def dequantize(self, packed: torch.Tensor, handle: Any, file: Path) -> torch.Tensor:
        """The fp32 weight of ``packed`` (read from ``handle``, an open safetensors ``file``)."""
        if self.scale_file == file:
            scale = handle.get_tensor(self.scale_key)
        else:
            from safetensors import safe_open

            with safe_open(str(self.scale_file), framework="pt", device="cpu") as other:
                scale = other.get_tensor(self.scale_key)
        return dequantize_mxfp4(packed, scale)


@dataclass
class PackedMatch:
    """Expected weights found as MXFP4 pairs: packed disk key -> its pair, and what did not fit."""

    pairs: dict[str, PackedPair] = field(default_factory=dict)
    weights: dict[str, str] = field(default_factory=dict)  # expected weight key -> its packed disk key
    missing: list[str] = field(default_factory=list)
    misshaped: list[str] = field(default_factory=list)

    @property
    def disk_keys(self) -> set[str]:
        """Every disk key the match accounts for (packed tensors, and the scales found for them)."""
        return set(self.weights.values()) | {pair.scale_key for pair in self.pairs.values()}


def with_packed_weights(names: Iterable[str]) -> set[str]:
    """``names`` (disk keys) plus ``X.weight`` for every ``X.weight_packed``: the weights an MXFP4 pair stands
    for, so that a layout is chosen by the names it would be read under (e.g. a checkpoint whose experts are
    on disk only packed, under ``language_model.layers.{i}``)."""
    names = set(names)
    return names | {
        key.removesuffix(PACKED_SUFFIX) + "weight" for key in names if key.endswith(PACKED_SUFFIX)
    }


def match_packed(expected: Mapping[str, tuple[int, ...]], headers: Mapping[str, _Header]) -> PackedMatch:
    """Pairs on disk for the expected weights (name -> shape [..., out, in]) that are not stored plain."""
    match = PackedMatch()
    for name, shape in expected.items():
        if not name.endswith(".weight") or name in headers:
            continue
        module = name.removesuffix("weight")
        packed_key, scale_key = module + PACKED_SUFFIX, module + SCALE_SUFFIX
        if packed_key not in headers:
            continue
        match.weights[name] = packed_key
        want_packed, want_scale = packed_shapes(shape)
        if shape[-1] % GROUP_SIZE:
            match.misshaped.append(
                f"{packed_key} (weight {name} {shape} has no whole groups of {GROUP_SIZE})"
            )
        else:
            _check(match, packed_key, headers[packed_key], want_packed)
        if scale_key not in headers:
            match.missing.append(f"{scale_key} (the MXFP4 weight {packed_key} needs its E8M0 scales)")
            continue
        _check(match, scale_key, headers[scale_key], want_scale)
        match.pairs[packed_key] = PackedPair(scale_key, headers[scale_key].file)
    return match


def _check(match: PackedMatch, key: str, disk: _Header, shape: tuple[int, ...]) -> None:
    if disk.shape != shape or disk.dtype != "U8":
        match.misshaped.append(f"{key} {disk.dtype} {disk.shape} (expected U8 {shape})")
