"""Export a dgemma `Transformer` to Hugging Face safetensors: `diffusion_gemma`, or plain Gemma 4 for AR serving.

    export_hf(model, "out/dir", layout="diffusion_gemma")     # DiffusionGemmaForBlockDiffusion
    export_hf(model, "out/dir", layout="gemma4_text")         # Gemma4ForCausalLM   (keys model.*)
    export_hf(model, "out/dir", layout="gemma4")              # Gemma4ForConditionalGeneration (model.language_model.*)

config.json is produced by transformers' own config classes from the model config (nothing hand-written), so its keys
are exactly what transformers serialises. diffusion_gemma layout (diffusiongemma.md §4.1): text weights under
`model.decoder.*` (the tie targets), the self-conditioning MLP, and `layer_scalar` twice: the decoder copy and
`model.encoder.language_model.layers.N.layer_scalar`. lm_head and the encoder text weights are tied, never stored.

Safety: files are written into a temporary directory next to the destination and renamed into place only when
complete, so an interrupted export leaves no destination directory; an existing destination is refused unless
`overwrite=True`. Every file's size and sha256 go into `dgemma_manifest.json`. Tensors are fetched from the devices
one at a time (the host never holds a second full copy of the model).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from dgemma.convert import keymap
from dgemma.convert.safetensors_io import write_safetensors
from dgemma.model.config import FULL, SLIDING, ModelConfig

LAYOUTS = ("diffusion_gemma", "gemma4_text", "gemma4")
TEXT_PREFIX = {"diffusion_gemma": "model.decoder.", "gemma4_text": "model.", "gemma4": "model.language_model."}
MANIFEST = "dgemma_manifest.json"
NP_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32),
             "float16": np.dtype(np.float16)}


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
        eos_token_id=list(cfg.eos_token_id) if len(cfg.eos_token_id) > 1 else cfg.eos_token_id[0],
        bos_token_id=cfg.bos_token_id, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=cfg.final_logit_softcapping or None,
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": cfg.rope_theta_sliding},
                         FULL: {"rope_type": "proportional", "partial_rotary_factor": cfg.partial_rotary_factor_full,
                                "rope_theta": cfg.rope_theta_full}},
    )
    if layout == "diffusion_gemma":
        kw["use_bidirectional_attention"] = "vision"
    else:
        kw.update(hidden_size_per_layer_input=0, attention_k_eq_v=True, enable_moe_block=True)
    return kw


def hf_config(cfg: ModelConfig, layout: str, vision_config: dict | None = None, extra: dict | None = None):
    """A transformers config object for `layout` (imported lazily: transformers is heavy)."""
    import transformers as tf

    text = hf_text_config(cfg, layout)
    if layout == "gemma4_text":
        return tf.Gemma4TextConfig(**text)
    if layout == "gemma4":
        return tf.Gemma4Config(text_config=text, vision_config=vision_config, audio_config=None, **(extra or {}))
    vision = tf.Gemma4VisionConfig(**vision_config) if vision_config is not None else None
    return tf.DiffusionGemmaConfig(text_config=tf.DiffusionGemmaTextConfig(**text), vision_config=vision,
                                   canvas_length=cfg.canvas_length, **(extra or {}))


def iter_hf_tensors(model, layout: str, dtype: np.dtype):
    """Yield (hf_key, numpy array) for every text tensor of the layout, fetching one parameter at a time."""
    cfg: ModelConfig = model.cfg
    flat = {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}

    def fetch(path):
        return np.asarray(jax.device_get(flat[path][...])).astype(np.float32)

    prefix = TEXT_PREFIX[layout]
    suffixes = keymap.hf_text_suffixes(cfg)
    if layout == "diffusion_gemma":
        if model.self_conditioning is None:
            raise ValueError("layout 'diffusion_gemma' needs the self-conditioning module (cfg.self_conditioning)")
        suffixes = suffixes + keymap.self_conditioning_suffixes()
    for suffix in suffixes:
        rule, paths = keymap.match(suffix)
        if suffix.endswith("layer_scalar") and layout == "diffusion_gemma" and not cfg.tie_layer_scalar:
            paths = [paths[0][:-1] + ("decoder_layer_scalar",)]
        yield prefix + suffix, rule.to_hf([fetch(p) for p in paths]).astype(dtype)
    if layout == "diffusion_gemma":
        for i in range(cfg.num_hidden_layers):
            yield (f"model.encoder.language_model.layers.{i}.layer_scalar",
                   fetch(("layers", i, "layer_scalar")).astype(dtype))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_shards(tmp: Path, tensors, max_shard_bytes: int) -> None:
    """Write tensors into shards of at most `max_shard_bytes` (one shard buffered at a time) plus the index."""
    written: list[tuple[str, list[str]]] = []
    shard: dict[str, np.ndarray] = {}
    size = 0

    def flush():
        name = f"shard-{len(written):05d}.safetensors"
        write_safetensors(tmp / name, shard, metadata={"format": "pt"})
        written.append((name, list(shard)))

    for key, arr in tensors:
        if shard and size + arr.nbytes > max_shard_bytes:
            flush()
            shard, size = {}, 0
        shard[key] = arr
        size += arr.nbytes
    if shard:
        flush()
    n = len(written)
    weight_map, total = {}, 0
    for i, (name, keys) in enumerate(written, start=1):
        final_name = f"model-{i:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors"
        os.rename(tmp / name, tmp / final_name)
        weight_map.update({k: final_name for k in keys})
        total += (tmp / final_name).stat().st_size
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def export_hf(model, out_dir, *, layout: str = "diffusion_gemma", dtype: str = "bfloat16",
              max_shard_size: int = 5 * 1024**3, overwrite: bool = False, vision_config: dict | None = None,
              generation_config: dict | None = None, tokenizer_dir=None, extra_files: dict | None = None) -> Path:
    """Write `model` as a HF checkpoint directory; returns the destination path."""
    if layout not in LAYOUTS:
        raise ValueError(f"export layout {layout!r} is not one of {LAYOUTS}")
    if dtype not in NP_DTYPES:
        raise ValueError(f"export dtype {dtype!r} is not one of {sorted(NP_DTYPES)}")
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=True (CLI: --overwrite) to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_shards(tmp, iter_hf_tensors(model, layout, NP_DTYPES[dtype]), max_shard_size)
        conf = hf_config(model.cfg, layout, vision_config)
        conf.dtype = dtype
        conf.architectures = [{"diffusion_gemma": "DiffusionGemmaForBlockDiffusion", "gemma4_text": "Gemma4ForCausalLM",
                               "gemma4": "Gemma4ForConditionalGeneration"}[layout]]
        conf.save_pretrained(tmp)
        if generation_config is not None:
            (tmp / "generation_config.json").write_text(json.dumps(generation_config, indent=2, sort_keys=True) + "\n")
        if tokenizer_dir is not None:
            for f in Path(tokenizer_dir).iterdir():
                if f.name.startswith(("tokenizer", "special_tokens", "chat_template")) and f.is_file():
                    shutil.copy2(f, tmp / f.name)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        files = sorted(p for p in tmp.iterdir() if p.is_file())
        manifest = {"layout": layout, "dtype": dtype,
                    "files": {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def verify_manifest(directory) -> None:
    """Check every file listed in the manifest (size and sha256); raise naming the first mismatch."""
    d = Path(directory)
    manifest = json.loads((d / MANIFEST).read_text())
    for name, meta in manifest["files"].items():
        p = d / name
        if not p.exists():
            raise ValueError(f"{p}: listed in {MANIFEST} but missing")
        if p.stat().st_size != meta["bytes"] or _sha256(p) != meta["sha256"]:
            raise ValueError(f"{p}: size/sha256 differ from {MANIFEST} (file modified or corrupt)")
