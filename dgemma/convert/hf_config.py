"""Hugging Face `config.json` <-> `ModelConfig` for Gemma 4 (`gemma4`, `gemma4_text`) and `diffusion_gemma`.

Import: `model_config_from_hf` reads a config.json. It accepts both serialisations of the full-layer geometry
(transformers' `Gemma4TextConfig`): the hub form (`global_head_dim`, `num_global_key_value_heads`) and what `save_pretrained` writes
(`per_layer_config` keyed by zero-padded or plain layer index). Features dgemma does not implement are refused, never silently ignored.
Export: `hf_config` / `hf_generation_config` build transformers' own config objects from a `ModelConfig` (and the
sampler settings), so the keys written are exactly what transformers serialises.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from dgemma.model.config import EXECUTION_FIELDS, FULL, SLIDING, ModelConfig

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
    """Translate a HF config dict; `overrides` set dgemma-only fields (tie_layer_scalar, ...) and execution settings
    (`ExecutionConfig` fields such as dtype, scan_layers, or `execution=`)."""
    mt, text = text_config_of(hf, source)
    is_diffusion = mt.startswith("diffusion_gemma")

    def need(key):
        if key not in text:
            raise CheckpointError(f"{source}: text config is missing required field {key!r}")
        return text[key]

    family = family_fields(text, is_diffusion)
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
        sliding_window=need("sliding_window"), rope_theta_sliding=theta_s, rope_theta_full=theta_f,
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
    if family["enable_moe_block"]:
        kwargs.update(num_experts=need("num_experts"), top_k_experts=need("top_k_experts"),
                      moe_intermediate_size=need("moe_intermediate_size"))
    kwargs.update(family)
    kwargs.update(overrides)
    execution = {k: kwargs.pop(k) for k in EXECUTION_FIELDS if k in kwargs}
    try:
        cfg = ModelConfig(**kwargs)
        return cfg.with_execution(**execution) if execution else cfg
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None


# transformers' Gemma4TextConfig defaults of the fields beyond 26B-A4B (a config.json may omit them)
FAMILY_DEFAULTS = dict(hidden_size_per_layer_input=256, vocab_size_per_layer_input=262_144, num_kv_shared_layers=0,
                       use_double_wide_mlp=False, enable_moe_block=False, attention_k_eq_v=False)


def family_fields(text: dict, is_diffusion: bool) -> dict:
    """PLE / KV sharing / MLP kind of a text config, with transformers' defaults; DiffusionGemma has none of them."""
    if is_diffusion:  # DiffusionGemmaTextConfig: always MoE with K = V full layers, no PLE, no KV sharing
        return dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False,
                    enable_moe_block=True, attention_k_eq_v=True)
    out = {k: (text[k] if text.get(k) is not None else d) for k, d in FAMILY_DEFAULTS.items()}
    for k in ("hidden_size_per_layer_input", "num_kv_shared_layers"):
        out[k] = int(out[k] or 0)
    return out


# MARK: ModelConfig -> transformers config objects (export) -----------------------------------------------------------


def hf_text_config(cfg: ModelConfig, layout: str) -> dict:
    """Gemma 4 text-config kwargs for transformers' config classes (hub form for the full-layer geometry)."""
    kw = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, global_head_dim=cfg.global_head_dim,
        num_global_key_value_heads=cfg.num_global_key_value_heads, layer_types=list(cfg.layer_types),
        sliding_window=cfg.sliding_window, num_experts=cfg.num_experts, top_k_experts=cfg.top_k_experts,
        moe_intermediate_size=cfg.moe_intermediate_size, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings, pad_token_id=cfg.pad_token_id,
        eos_token_id=_eos(cfg), bos_token_id=cfg.bos_token_id, tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=cfg.final_logit_softcapping or None,
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": cfg.rope_theta_sliding},
                         FULL: {"rope_type": "proportional", "partial_rotary_factor": cfg.partial_rotary_factor_full,
                                "rope_theta": cfg.rope_theta_full}},
    )
    if layout == "diffusion_gemma":
        refuse_diffusion_gemma_layout(cfg)
        kw["use_bidirectional_attention"] = "vision"
    else:
        kw.update(hidden_size_per_layer_input=cfg.hidden_size_per_layer_input,
                  vocab_size_per_layer_input=cfg.vocab_size_per_layer_input,
                  num_kv_shared_layers=cfg.num_kv_shared_layers, use_double_wide_mlp=cfg.use_double_wide_mlp,
                  attention_k_eq_v=cfg.attention_k_eq_v, enable_moe_block=cfg.enable_moe_block)
        if not cfg.enable_moe_block:
            kw.update(num_experts=None, top_k_experts=None, moe_intermediate_size=None)
    return kw


def refuse_diffusion_gemma_layout(cfg: ModelConfig) -> None:
    """transformers' DiffusionGemma is the 26B-A4B geometry only (MoE, K = V full layers, no PLE, no KV sharing)."""
    lacking = [name for name, has in (("per-layer embeddings (hidden_size_per_layer_input)",
                                       cfg.hidden_size_per_layer_input > 0),
                                      ("KV sharing (num_kv_shared_layers)", cfg.num_kv_shared_layers > 0),
                                      ("a dense-only MLP (enable_moe_block=false)", not cfg.enable_moe_block),
                                      ("full layers with their own V (attention_k_eq_v=false)",
                                       not cfg.attention_k_eq_v)) if has]
    if lacking:
        raise ValueError(f"export layout 'diffusion_gemma': transformers' DiffusionGemma cannot represent "
                         f"{', '.join(lacking)}; export with layout 'gemma4' (or 'gemma4_text') instead")


def _eos(cfg: ModelConfig):
    return list(cfg.eos_token_id) if len(cfg.eos_token_id) > 1 else cfg.eos_token_id[0]


def hf_config(cfg: ModelConfig, layout: str, vision_config: dict | None = None, extra: dict | None = None):
    """A transformers config object for `layout` (imported lazily: transformers is heavy)."""
    import transformers as tf

    text = hf_text_config(cfg, layout)
    if layout == "gemma4_text":
        return tf.Gemma4TextConfig(**text)
    if layout == "gemma4":
        return tf.Gemma4Config(text_config=text, vision_config=vision_config, audio_config=None, **(extra or {}))
    return tf.DiffusionGemmaConfig(text_config=tf.DiffusionGemmaTextConfig(**text), vision_config=vision_config,
                                   canvas_length=cfg.canvas_length, **(extra or {}))


SAMPLER_TO_HF = {"max_steps": "max_denoising_steps", "max_denoising_steps": "max_denoising_steps",
                 "t_min": "t_min", "t_max": "t_max", "stability_threshold": "stability_threshold",
                 "confidence_threshold": "confidence_threshold", "max_new_tokens": "max_new_tokens"}
_CASTS = {"max_denoising_steps": int, "stability_threshold": int, "max_new_tokens": int, "t_min": float,
          "t_max": float, "confidence_threshold": float}
# dgemma sampler settings that HF's sampler does not have: they change nothing in what the exported model generates
# (mode / AR fallback, random-bit source, loop-exit bookkeeping, recording) or are inactive under HF_ALGORITHM.
_DGEMMA_ONLY = ("mode", "sampling", "ar_temperature", "auto_entropy_threshold", "wait_for_finished_rows",
                "record_drafts", "record_states", "accept_confidence", "ancestral_temperature", "eos_ids", "pad_id")
HF_ALGORITHM = {"algorithm": "eb", "accept": "entropy_bound", "greedy": False}
"""The only decoding rule `diffusion_gemma`'s generate runs; an export with another one is refused."""


def hf_generation_config(cfg: ModelConfig, layout: str, sampler=None, tokenizer_ids: dict | None = None):
    """generation_config for the layout. diffusion_gemma: transformers' `_get_default_generation_params`, overlaid
    with `sampler` (a `SamplerSection`, or a dict with its or HF's names; `entropy_bound` -> `sampler_config`), plus
    the model's eos/pad/bos ids. AR layouts: a plain `GenerationConfig` with the ids. `tokenizer_ids`
    ({"eos": [...], "pad": id | None}, `tokenizer_files.special_ids`) adds the tokenizer's stop ids (`<turn|>`
    included) after the model's and takes its PAD."""
    eos = list(dict.fromkeys([*cfg.eos_token_id, *(tokenizer_ids or {}).get("eos", ())]))
    pad = (tokenizer_ids or {}).get("pad")
    ids = dict(bos_token_id=cfg.bos_token_id, eos_token_id=eos if len(eos) > 1 else eos[0],
               pad_token_id=cfg.pad_token_id if pad is None else pad)
    if layout != "diffusion_gemma":
        from transformers import GenerationConfig

        return GenerationConfig(**ids)
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        DiffusionGemmaGenerationConfig, EntropyBoundSamplerConfig)

    params = DiffusionGemmaGenerationConfig._get_default_generation_params()
    is_section = dataclasses.is_dataclass(sampler) and not isinstance(sampler, type)  # an instance, not a class
    settings = dataclasses.asdict(sampler) if is_section else dict(sampler or {})
    for name, value in settings.items():
        if name == "entropy_bound":
            params["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=float(value))
        elif name == "sampler_config":
            params["sampler_config"] = value
        elif name in SAMPLER_TO_HF:
            params[SAMPLER_TO_HF[name]] = _CASTS[SAMPLER_TO_HF[name]](value)
        elif name in HF_ALGORITHM:
            if value != HF_ALGORITHM[name]:
                raise ValueError(f"generation_config: sampler.{name}={value!r} has no diffusion_gemma equivalent "
                                 f"(transformers runs {HF_ALGORITHM}); export with those settings or layout gemma4")
        elif name not in _DGEMMA_ONLY:
            raise ValueError(f"generation_config: unknown sampler setting {name!r}")
    return DiffusionGemmaGenerationConfig(**params, **ids)
