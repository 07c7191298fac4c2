"""FP8 (e4m3) block quantisation in the FineGrainedFP8 / DeepSeek-V3 checkpoint format.

Format (what transformers' `FineGrainedFP8Config` (`quant_method: "fp8"`) and vLLM's `Fp8Config` read):

    <linear>.weight            float8_e4m3fn [N, K]           (HF [out, in] orientation, unchanged)
    <linear>.weight_scale_inv  float32 [ceil(N/bn), ceil(K/bk)]   w ~= q * scale_inv, one scale per bn x bk block
    experts.gate_up_proj            float8_e4m3fn [E, 2I, H]   (fused 3-D experts, transformers' `FP8Experts`)
    experts.gate_up_proj_scale_inv  float32 [E, max(ceil(2I/bn), 2), ceil(H/bk)]
    experts.down_proj               float8_e4m3fn [E, H, I]
    experts.down_proj_scale_inv     float32 [E, ceil(H/bn), ceil(I/bk)]

config.json carries `quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic",
"weight_block_size": [bn, bk], "modules_to_not_convert": [...]}` built by transformers' own `FineGrainedFP8Config`.
Quantised: every attention / dense-MLP / self-conditioning linear and both expert tensors. Kept in the export dtype
(bf16): embeddings (and the tied lm_head), norms, router (`router.proj`, `router.scale`, `per_expert_scale`),
`layer_scalar`, the vision tower and `embed_vision`.

Scale rule (identical to transformers' `Fp8Quantize`, extended to partial edge blocks): per block,
`scale = 448 / amax` (1 for an all-zero block), `q = clip(w * scale, -448, 448)` cast to e4m3 (round to nearest
even), `scale_inv = 1 / scale`. transformers' `FP8Experts` allocates at least 2 scale rows for the fused gate_up
tensor (`min_sf_out=2`, one per half); when `2I <= bn` the single block row is duplicated so that either reading
(row = n // bn, or one row per half) dequantises identically.

`expert_layout="per_expert"` writes `experts.{e}.{gate,up,down}_proj.weight` (+ `.weight_scale_inv`) instead: the
layout vLLM's Gemma 4 loader expects for quantised experts. transformers cannot load that layout (it has no
conversion mapping for Gemma 4 experts), so the default is `"fused"`.
"""

from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
EXPERT_LAYOUTS = ("fused", "per_expert")

# HF text suffixes (after the layout prefix) whose tensors are quantised.
_QUANTISED = re.compile(r"(layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight"
                        r"|layers\.\d+\.experts\.(gate_up|down)_proj"
                        r"|self_conditioning\.(gate|up|down)_proj\.weight)")


def is_quantised(suffix: str) -> bool:
    return _QUANTISED.fullmatch(suffix) is not None


def scale_key(key: str) -> str:
    """`x.weight` -> `x.weight_scale_inv`; a bare parameter (`experts.down_proj`) -> `experts.down_proj_scale_inv`."""
    return key[: -len(".weight")] + ".weight_scale_inv" if key.endswith(".weight") else key + "_scale_inv"


def scale_shape(key: str, shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    bn, bk = block
    rows = -(-shape[-2] // bn)
    if key.endswith("experts.gate_up_proj"):
        rows = max(rows, 2)  # FP8Experts: min_sf_out=2 for the fused gate_up projection
    return (*shape[:-2], rows, -(-shape[-1] // bk))


def quantize(w: np.ndarray, block: tuple[int, int], *, min_rows: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Block-quantise the last two axes of `w` -> (e4m3 array of w's shape, float32 scale_inv grid)."""
    bn, bk = block
    *lead, n, k = w.shape
    rn, rk = -(-n // bn), -(-k // bk)
    x = np.asarray(w, np.float32)
    pad = [(0, 0)] * len(lead) + [(0, rn * bn - n), (0, rk * bk - k)]
    xp = np.pad(x, pad) if (rn * bn != n or rk * bk != k) else x
    tiles = xp.reshape(*lead, rn, bn, rk, bk)
    amax = np.abs(tiles).max(axis=(-3, -1))  # [..., rn, rk]
    scale = np.where(amax > 0, FP8_MAX / np.where(amax > 0, amax, 1.0), 1.0).astype(np.float32)
    q = np.clip(tiles * scale[..., :, None, :, None], -FP8_MAX, FP8_MAX).astype(FP8)
    q = q.reshape(*lead, rn * bn, rk * bk)[..., :n, :k]
    inv = (1.0 / scale).astype(np.float32)
    if rn < min_rows:
        inv = np.repeat(inv, min_rows, axis=-2)
    return np.ascontiguousarray(q), inv


def dequantize(q: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """Inverse of `quantize` (float32), for block-aligned or ceil-div grids; duplicated gate_up rows collapse."""
    bn, bk = block
    n, k = q.shape[-2:]
    rn = -(-n // bn)
    s = scale_inv[..., :rn, :] if scale_inv.shape[-2] > rn else scale_inv
    full = np.repeat(np.repeat(s, bn, axis=-2), bk, axis=-1)[..., :n, :k]
    return q.astype(np.float32) * full


def quantize_tensor(key: str, w: np.ndarray, block: tuple[int, int]) -> dict[str, np.ndarray]:
    min_rows = 2 if key.endswith("experts.gate_up_proj") else 1
    q, inv = quantize(w, block, min_rows=min_rows)
    return {key: q, scale_key(key): inv}


def per_expert_split(key: str, w: np.ndarray) -> dict[str, np.ndarray]:
    """Fused 3-D expert tensor -> per-expert 2-D HF linears (vLLM's layout for quantised Gemma 4 experts)."""
    base = key.rsplit(".", 1)[0]  # ...layers.N.experts
    out = {}
    if key.endswith("gate_up_proj"):
        inter = w.shape[1] // 2
        for e in range(w.shape[0]):
            out[f"{base}.{e}.gate_proj.weight"] = w[e, :inter]
            out[f"{base}.{e}.up_proj.weight"] = w[e, inter:]
    else:
        for e in range(w.shape[0]):
            out[f"{base}.{e}.down_proj.weight"] = w[e]
    return out


def not_converted(layout: str, has_vision: bool) -> list[str]:
    """`modules_to_not_convert`: module names (transformers matches a prefix at a module boundary, or a suffix)."""
    skip = ["lm_head", "router.proj"]
    if layout == "diffusion_gemma":
        skip += ["model.encoder.vision_tower", "model.encoder.embed_vision"] if has_vision else []
    elif layout == "gemma4":
        skip += ["model.vision_tower", "model.embed_vision"] if has_vision else []
    return skip


def quantization_config(layout: str, block: tuple[int, int], has_vision: bool):
    """config.json `quantization_config`: transformers' own FineGrainedFP8Config (it serialises itself)."""
    from transformers import FineGrainedFP8Config

    # a list, as config.json carries it and transformers loads it (its annotation says tuple)
    return FineGrainedFP8Config(activation_scheme="dynamic", weight_block_size=list(block),  # type: ignore[arg-type]
                                modules_to_not_convert=not_converted(layout, has_vision))


def block_mismatches(shapes: dict[str, tuple[int, ...]], block: tuple[int, int]) -> list[str]:
    """Quantised tensors whose [N, K] are not multiples of the block (partial edge blocks). transformers' GPU kernels
    handle them (ceil-div grids); its CPU dequantise path and vLLM's merged/MoE block checks need exact multiples."""
    bn, bk = block
    return [f"{k} {list(s)}" for k, s in shapes.items() if s[-2] % bn or s[-1] % bk]


def suggest_block(dims: list[int], candidates=(128, 64, 32, 16)) -> int:
    """Largest candidate block edge dividing every dim (the 26B model: 64, since I=2112 and I_moe=704)."""
    for c in candidates:
        if all(d % c == 0 for d in dims):
            return c
    return math.gcd(*dims)
