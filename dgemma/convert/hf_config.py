"""Hugging Face `config.json` <-> `ModelConfig` for Gemma 4 (`gemma4`, `gemma4_text`) and `diffusion_gemma`.

Accepts both serialisations of the full-layer geometry (gemma4.md §1.3): the hub form
(`global_head_dim`, `num_global_key_value_heads`) and what `save_pretrained` writes (`per_layer_config` keyed by
zero-padded or plain layer index). Features dgemma does not implement are refused, never silently ignored.
"""

from __future__ import annotations

import json
from pathlib import Path

from dgemma.model.config import FULL, SLIDING, ModelConfig

SUPPORTED_MODEL_TYPES = ("gemma4", "gemma4_text", "diffusion_gemma", "diffusion_gemma_text")


class CheckpointError(ValueError):
    """A checkpoint could not be read or does not match the model; the message names file, key and shapes."""


def read_config_json(path: Path) -> dict:
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise CheckpointError(f"{file}: config.json not found (a Hugging Face checkpoint directory needs one)")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: invalid JSON ({e})") from None


def text_config_of(hf: dict, source: str = "config.json") -> tuple[str, dict]:
    """(top-level model_type, text config dict)."""
    mt = hf.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"{source}: unknown model_type {mt!r}; dgemma reads {list(SUPPORTED_MODEL_TYPES)}")
    if mt in ("gemma4", "diffusion_gemma"):
        if not isinstance(hf.get("text_config"), dict):
            raise CheckpointError(f"{source}: model_type {mt!r} needs a nested 'text_config' object")
        return mt, hf["text_config"]
    return mt, hf


def _rope(text: dict, layer_type: str, source: str) -> tuple[float, float]:
    params = (text.get("rope_parameters") or {}).get(layer_type)
    defaults = {SLIDING: ("default", 10_000.0, 1.0), FULL: ("proportional", 1_000_000.0, 0.25)}[layer_type]
    if params is None:
        return defaults[1], defaults[2]
    rtype = params.get("rope_type", defaults[0])
    expected = defaults[0]
    if rtype != expected:
        raise CheckpointError(f"{source}: rope_parameters.{layer_type}.rope_type={rtype!r} is not supported "
                              f"(dgemma implements {expected!r} for {layer_type})")
    if float(params.get("factor", 1.0)) != 1.0:
        raise CheckpointError(f"{source}: rope_parameters.{layer_type}.factor != 1 is not supported")
    return float(params.get("rope_theta", defaults[1])), float(params.get("partial_rotary_factor", defaults[2]))


def model_config_from_hf(hf: dict, source: str = "config.json", **overrides) -> ModelConfig:
    """Translate a HF config dict; `overrides` set dgemma-only fields (dtype, tie_layer_scalar, ...)."""
    mt, text = text_config_of(hf, source)
    is_diffusion = mt.startswith("diffusion_gemma")

    def need(key):
        if key not in text:
            raise CheckpointError(f"{source}: text config is missing required field {key!r}")
        return text[key]

    refuse = {
        "hidden_size_per_layer_input": lambda v: v not in (None, 0),
        "num_kv_shared_layers": lambda v: v not in (None, 0),
        "use_double_wide_mlp": lambda v: bool(v),
    }
    for key, bad in refuse.items():
        if key in text and bad(text[key]):
            raise CheckpointError(f"{source}: {key}={text[key]!r} (PLE / KV sharing / double-wide MLP) is not "
                                  "supported by dgemma; only the 26B-A4B family (MoE, no PLE) is")
    if not is_diffusion:
        for key in ("enable_moe_block", "attention_k_eq_v"):
            if not text.get(key, False):
                raise CheckpointError(f"{source}: {key}={text.get(key)!r}; dgemma implements the 26B-A4B family "
                                      "where it is true")
    if text.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise CheckpointError(f"{source}: hidden_activation={text['hidden_activation']!r} is not supported")
    if text.get("attention_bias"):
        raise CheckpointError(f"{source}: attention_bias=true is not supported")

    layer_types = tuple(need("layer_types"))
    full_layers = [i for i, t in enumerate(layer_types) if t == FULL]
    global_head_dim = text.get("global_head_dim")
    global_kv = text.get("num_global_key_value_heads")
    plc = text.get("per_layer_config")
    if plc:
        by_index = {int(k): v for k, v in plc.items()}
        for i in full_layers:
            entry = by_index.get(i)
            if entry is None:
                raise CheckpointError(f"{source}: per_layer_config has no entry for full-attention layer {i}")
            global_head_dim = entry.get("head_dim", global_head_dim)
            global_kv = entry.get("num_key_value_heads", global_kv)
        sliding_overrides = [i for i in by_index if layer_types[i] == SLIDING]
        if sliding_overrides:
            raise CheckpointError(f"{source}: per_layer_config overrides sliding layers {sliding_overrides}; "
                                  "dgemma supports overrides on full-attention layers only")
    global_head_dim = 512 if global_head_dim is None else global_head_dim  # transformers' default
    global_kv = need("num_key_value_heads") if global_kv is None else global_kv
    theta_s, _ = _rope(text, SLIDING, source)
    theta_f, prf = _rope(text, FULL, source)
    eos = text.get("eos_token_id", 1)
    kwargs = dict(
        vocab_size=need("vocab_size"), hidden_size=need("hidden_size"), intermediate_size=need("intermediate_size"),
        num_hidden_layers=need("num_hidden_layers"), num_attention_heads=need("num_attention_heads"),
        num_key_value_heads=need("num_key_value_heads"), head_dim=need("head_dim"),
        global_head_dim=global_head_dim, num_global_key_value_heads=global_kv, layer_types=layer_types,
        sliding_window=need("sliding_window"), num_experts=need("num_experts"), top_k_experts=need("top_k_experts"),
        moe_intermediate_size=need("moe_intermediate_size"), rope_theta_sliding=theta_s, rope_theta_full=theta_f,
        partial_rotary_factor_full=prf, rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        final_logit_softcapping=30.0 if is_diffusion else (text.get("final_logit_softcapping") or 0.0),
        max_position_embeddings=text.get("max_position_embeddings", 131_072),
        pad_token_id=text.get("pad_token_id", 0) if text.get("pad_token_id") is not None else 0,
        eos_token_id=tuple(eos) if isinstance(eos, list) else (eos if eos is not None else 1,),
        bos_token_id=text.get("bos_token_id", 2) if text.get("bos_token_id") is not None else 2,
        canvas_length=hf.get("canvas_length", 256) if is_diffusion else overrides.pop("canvas_length", 256),
    )
    if not is_diffusion and not text.get("tie_word_embeddings", hf.get("tie_word_embeddings", True)):
        raise CheckpointError(f"{source}: tie_word_embeddings=false is not supported (Gemma 4 ties the LM head)")
    kwargs.update(overrides)
    try:
        return ModelConfig(**kwargs)
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None
