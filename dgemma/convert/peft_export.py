"""The adapters of an adapted run (`lora.rank > 0`), unmerged, in PEFT's LoRA format.

    export_peft(adapted_model, "exports/adapters", layout="diffusion_gemma")    # adapter_config.json +
                                                                                 # adapter_model.safetensors

transformers loads them with `peft` on top of an export of the run's base (`dgemma export` of the params the run
started from, same layout): `PeftModel.from_pretrained(base, "exports/adapters")`. Each dgemma adapter
(`dgemma.model.lora`: A [*in, r], B [r, *out], y = x.W + (alpha / r) (x.A).B) becomes PEFT's pair on the HF module
that holds its base weight, found through the one key table (`dgemma.convert.keymap`):

| adapter of                        | PEFT target                                  | lora_A.weight | lora_B.weight |
|-----------------------------------|----------------------------------------------|---------------|---------------|
| attention, dense MLP, router,     | module `...q_proj` etc. (target_modules)     | [r, in]       | [out, r]      |
| self-conditioning MLP             |                                              |               |               |
| experts gate, up [E, H, I] (two)  | parameter `...experts.gate_up_proj` (rank 2r) | [E*2r, H]    | [2I, 2r*E]    |
| experts down [E, I, H]            | parameter `...experts.down_proj`             | [E*r, I]      | [H, r*E]      |

The experts are PEFT `target_parameters` (its `ParamWrapper`, for 3-D expert weights): lora_A's rows are
expert-major (e*R + k), lora_B's columns rank-major (k*E + e), the layout PEFT reshapes them from. transformers
fuses gate and up into one `gate_up_proj` [E, 2I, H], and one low-rank pair cannot hold two independent ones, so
they are exported as one pair of rank 2r: A = [A_gate | A_up] along the rank, B block-diagonal (zeros where only one
of them is adapted), alpha 2*alpha so that the scale stays alpha / r; exact, not an approximation. When one module
holds both expert targets, PEFT nests its wrappers: gate_up_proj's pair is under `experts.base_layer.`, down_proj's
under `experts.` (checked against peft 0.21 in tests/convert/test_lora_export.py; that version warns that `rank_pattern` /
`alpha_pattern` "did not match any targeted module" but applies them to the parameter targets: the test loads
the rank-2r pair and matches the logits).

The diffusion_gemma layout ties the encoder's text weights to the decoder's; PEFT adapts modules, not tied
tensors, so every text adapter is written for both copies (`model.encoder.language_model.` and `model.decoder.`),
the self-conditioning ones for the decoder. Module names are listed in full, so nothing else (e.g. the vision
tower's q_proj) matches. Written atomically beside the destination (as `dgemma.convert.hf_export`), with a manifest.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import numpy as np
from flax import nnx

from dgemma.convert import keymap
from dgemma.convert.destination import check_destination, write_export_dir
from dgemma.convert.hf_export import LAYOUTS, NP_DTYPES, TEXT_PREFIX
from dgemma.convert.safetensors_io import write_safetensors

if TYPE_CHECKING:
    from dgemma.model.config import ModelConfig

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "export_peft", "peft_adapter"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModel's name for the wrapped transformers model in saved adapter keys
TASK_TYPE = {"gemma4_text": "CAUSAL_LM", "gemma4": None, "diffusion_gemma": None}
_GATE_UP, _DOWN = "gate_up_proj", "down_proj"


def _adapter_pairs(model) -> dict[tuple, dict[str, np.ndarray]]:
    """{base weight path under per-layer names: {"a": A, "b": B}} (fp32 numpy, one layer's slice each)."""
    cfg = model.cfg
    flat = keymap.per_layer_params(cfg, {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))})
    pairs: dict[tuple, dict[str, np.ndarray]] = {}
    for path, var in flat.items():
        i = path.index("lora")  # <module>/lora/<weight>/{a,b}
        base = path[:i] + (path[i + 1],)
        pairs.setdefault(base, {})[path[-1]] = np.asarray(jax.device_get(var[...]), np.float32)
    return pairs


def _hf_names(cfg: ModelConfig, layout: str) -> dict[tuple, tuple[str, int]]:
    """dgemma base weight path -> (HF tensor suffix, index among the arrays that tensor is made of)."""
    suffixes = keymap.hf_text_suffixes(cfg)
    if layout == "diffusion_gemma":
        suffixes = suffixes + keymap.self_conditioning_suffixes()
    names = {}
    for suffix in suffixes:
        found = keymap.match(suffix)
        assert found is not None  # hf_text_suffixes lists only suffixes a keymap rule matches
        _, paths = found
        for index, p in enumerate(paths):
            names[p] = (suffix, index)
    return names


def _linear(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A [*in, r], B [r, *out] -> PEFT Linear lora_A [r, in], lora_B [out, r] (HF flattens heads as dgemma does)."""
    r = a.shape[-1]
    return a.reshape(-1, r).T, b.reshape(r, -1).T


def _experts(pairs: list[dict | None], rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-expert adapters (A [E, K, r], B [E, r, N]) of the fused halves of one HF expert tensor -> PEFT's
    ParamWrapper lora_A [E*R, K], lora_B [sum N, R*E] with R = rank * len(pairs), B block-diagonal over the halves;
    a missing half (None) gets zeros."""
    present = [p for p in pairs if p is not None]
    n_exp, k_in = present[0]["a"].shape[:2]
    outs = [p["b"].shape[-1] if p is not None else present[0]["b"].shape[-1] for p in pairs]
    big_r = rank * len(pairs)
    a = np.zeros((n_exp, big_r, k_in), np.float32)
    b = np.zeros((n_exp, big_r, sum(outs)), np.float32)
    col = 0
    for h, (p, n_out) in enumerate(zip(pairs, outs)):
        if p is not None:
            a[:, h * rank:(h + 1) * rank] = p["a"].transpose(0, 2, 1)
            b[:, h * rank:(h + 1) * rank, col:col + n_out] = p["b"]
        col += n_out
    return a.reshape(n_exp * big_r, k_in), np.ascontiguousarray(b.transpose(2, 1, 0)).reshape(sum(outs), -1)


def peft_adapter(model, layout: str, *, rank: int, alpha: float, dtype: str = "bfloat16",
                 base_model: str | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """({saved adapter key: array}, adapter_config dict) of an adapted `model` for the HF `layout` (module docstring).
    Raises ValueError naming the adapter for one whose base weight has no HF tensor in that layout."""
    if layout not in LAYOUTS:
        raise ValueError(f"export layout {layout!r} is not one of {LAYOUTS}")
    if layout == "diffusers":  # the pipeline's model is a diffusion_gemma DiffusionGemmaForBlockDiffusion
        layout = "diffusion_gemma"
    if dtype not in NP_DTYPES:
        raise ValueError(f"export dtype {dtype!r} is not one of {sorted(NP_DTYPES)}")
    cfg = model.cfg
    pairs = _adapter_pairs(model)
    if not pairs:
        raise ValueError("the model has no LoRA adapters to export")
    names = _hf_names(cfg, layout)
    text_prefixes = (["model.encoder.language_model.", TEXT_PREFIX[layout]] if layout == "diffusion_gemma"
                     else [TEXT_PREFIX[layout]])
    modules: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # HF module suffix -> (lora_A, lora_B)
    expert_halves: dict[str, list] = {}  # HF expert tensor suffix -> [pair or None per fused half]
    for path, pair in pairs.items():
        if path[0] == "self_conditioning" and layout != "diffusion_gemma":
            continue  # the gemma4 layouts are the AR path: no self-conditioning (the merged export drops it too)
        if path not in names:
            raise ValueError(f"adapter of {'/'.join(map(str, path))}: no HF tensor holds its base weight in the "
                             f"{layout!r} layout")
        suffix, index = names[path]
        if suffix.endswith(".weight"):
            modules[suffix[:-len(".weight")]] = _linear(pair["a"], pair["b"])
        else:
            halves = expert_halves.setdefault(suffix, [None, None] if suffix.endswith(_GATE_UP) else [None])
            halves[index] = pair
    tensors, target_modules, target_parameters, nested = {}, [], [], set()
    for suffix in expert_halves:  # a module whose gate_up_proj and down_proj are both adapted nests its wrappers
        module = suffix.rpartition(".")[0]
        if suffix.endswith(_GATE_UP) and f"{module}.{_DOWN}" in expert_halves:
            nested.add(suffix)
    np_dtype = NP_DTYPES[dtype]
    for prefix in text_prefixes:
        for suffix, (a, b) in sorted(modules.items()):
            if suffix.startswith("self_conditioning.") and prefix != TEXT_PREFIX[layout]:
                continue  # the encoder has no self-conditioning path
            target_modules.append(prefix + suffix)
            tensors[f"{PEFT_PREFIX}{prefix}{suffix}.lora_A.weight"] = a.astype(np_dtype)
            tensors[f"{PEFT_PREFIX}{prefix}{suffix}.lora_B.weight"] = b.astype(np_dtype)
        for suffix, halves in sorted(expert_halves.items()):
            module = suffix.rpartition(".")[0] + (".base_layer" if suffix in nested else "")
            a, b = _experts(halves, rank)
            target_parameters.append(prefix + suffix)
            tensors[f"{PEFT_PREFIX}{prefix}{module}.lora_A.weight"] = a.astype(np_dtype)
            tensors[f"{PEFT_PREFIX}{prefix}{module}.lora_B.weight"] = b.astype(np_dtype)
    fused = any(s.endswith(_GATE_UP) for s in expert_halves)
    config = {
        "peft_type": "LORA", "task_type": TASK_TYPE[layout], "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": float(alpha), "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
        "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "target_modules": target_modules, "target_parameters": target_parameters or None,
        # the fused gate_up_proj pair has rank 2r; alpha doubles with it so its scale stays alpha / r
        "rank_pattern": {_GATE_UP: 2 * rank} if fused else {},
        "alpha_pattern": {_GATE_UP: 2.0 * float(alpha)} if fused else {},
    }
    return tensors, config


def export_peft(model, out_dir, *, layout: str, rank: int, alpha: float, dtype: str = "bfloat16",
                base_model: str | None = None, overwrite: bool = False, sources=()) -> Path:
    """Write the adapters of `model` to `out_dir` in PEFT's format (adapter_config.json, adapter_model.safetensors,
    dgemma's manifest); atomically, as `dgemma.convert.hf_export.export_hf` does. Returns the destination."""
    out = Path(out_dir)
    check_destination(out, overwrite=overwrite, kind="export", sources=sources)
    tensors, config = peft_adapter(model, layout, rank=rank, alpha=alpha, dtype=dtype, base_model=base_model)

    def fill(tmp: Path) -> None:
        write_safetensors(tmp / ADAPTER_WEIGHTS, tensors, metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")

    write_export_dir(out, fill, {"layout": layout, "dtype": dtype, "quantization": None, "format": "peft_lora"},
                     overwrite=overwrite, sources=sources)
    return out
