"""Import Hugging Face Gemma 4 / DiffusionGemma safetensors into a dgemma `Transformer`, streaming.

    model, report = load_hf_checkpoint("path/to/ckpt", mesh=mesh, rules="experts_on_fsdp")

Layouts (key prefixes) recognised, by `config.json` model_type:
    gemma4_text      model.<text>                       (Gemma4ForCausalLM)
    gemma4           model.language_model.<text>        (released multimodal Gemma4ForConditionalGeneration)
    diffusion_gemma  model.decoder.<text> + model.decoder.self_conditioning.* +
                     model.encoder.language_model.layers.N.layer_scalar   (encoder copy of the scalar)
Vision / audio tower tensors are skipped (one log line). Anything else is an error, as is any dgemma parameter left
unfilled.

Streaming: the model is built abstractly (`nnx.eval_shape`, no allocation); each tensor is read alone, converted,
and `device_put` straight onto its target sharding, so the host never holds a second copy of the model.

AR -> DiffusionGemma (a gemma4 checkpoint loaded with self-conditioning on): the tensors the AR checkpoint lacks are
initialised by this documented rule, which leaves the encoder (causal) path bit-identical to the AR model:
    decoder layer_scalar  = copy of the AR layer_scalar (Google's converter clones `skip_scale` the same way)
    self_conditioning     = pre_norm 1, gate/up/down ~ N(0, sc_init_std) from `seed` (HF `_init_weights`: 0.02)
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dgemma.convert import keymap
from dgemma.convert.hf_config import CheckpointError, model_config_from_hf, read_config_json
from dgemma.convert.safetensors_io import SafetensorsFile, checkpoint_files
from dgemma.model.transformer import abstract_model
from dgemma.parallel.rules import get_rules, state_shardings

if TYPE_CHECKING:
    from dgemma.model.config import ModelConfig

log = logging.getLogger(__name__)

TEXT_PREFIX = {"gemma4_text": "model.", "gemma4": "model.language_model.", "diffusion_gemma": "model.decoder."}
SKIP_PREFIXES = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.",
                 "model.encoder.vision_tower.", "model.encoder.embed_vision.")
ENCODER_SCALAR = "model.encoder.language_model.layers.{}.layer_scalar"


@dataclasses.dataclass
class ImportReport:
    model_type: str
    files: list[str]
    loaded: int = 0
    skipped: list[str] = dataclasses.field(default_factory=list)
    initialised: list[str] = dataclasses.field(default_factory=list)
    bytes_loaded: int = 0


def _path_str(path) -> str:
    return ".".join(str(p) for p in path)


def _classify(key: str, model_type: str) -> tuple[str, str]:
    """-> (kind, text suffix; "" for skip | lm_head | unexpected). kind: text | encoder_scalar | lm_head | skip |
    unexpected."""
    if key.startswith(SKIP_PREFIXES):
        return "skip", ""
    if key == "lm_head.weight":
        return "lm_head", ""
    if model_type == "diffusion_gemma" and key.startswith("model.encoder.language_model.layers."):
        rest = key[len("model.encoder.language_model."):]
        if rest.endswith(".layer_scalar"):
            return "encoder_scalar", rest
        return "unexpected", ""
    prefix = TEXT_PREFIX[model_type]
    if key.startswith(prefix):
        return "text", key[len(prefix):]
    return "unexpected", ""


def load_hf_checkpoint(path, *, mesh=None, rules="fsdp", dtype: str | None = None, param_dtype: str | None = None,
                       self_conditioning: bool | None = None, tie_layer_scalar: bool | None = None,
                       sc_init_std: float = 0.02, seed: int = 0, verify: bool = True, **config_overrides):
    """Load a HF checkpoint directory. Returns (Transformer, ImportReport).

    self_conditioning: default True for diffusion_gemma (loaded) and for gemma4 (initialised, see module doc).
    tie_layer_scalar: default = tied iff every encoder/decoder scalar pair in the checkpoint is equal.
    verify: when the directory holds a `dgemma_manifest.json` (written by `dgemma.convert.hf_export`), check every
      file's size and sha256 against it before reading anything.
    """
    path = Path(path)
    if verify and (path / "dgemma_manifest.json").exists():
        from dgemma.convert.hf_export import verify as verify_manifest

        try:
            verify_manifest(path)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    hf = read_config_json(path)
    model_type = hf.get("model_type")
    files = checkpoint_files(path)
    if model_type not in TEXT_PREFIX:
        model_config_from_hf(hf, str(path / "config.json"))  # raises the precise unknown-model_type error
        raise CheckpointError(f"{path / 'config.json'}: model_type {model_type!r} (a text-only sub-config) cannot be "
                              f"a checkpoint's top-level type; expected one of {sorted(TEXT_PREFIX)}")
    readers = {name: SafetensorsFile(path / name) for name in files}
    for name, indexed in files.items():  # the index must agree with what the files actually hold
        if indexed is not None:
            absent = sorted(set(indexed) - set(readers[name].keys()))
            if absent:
                raise CheckpointError(f"{path / name}: keys {absent[:5]} are listed in model.safetensors.index.json "
                                      "but missing from the file")
    is_diffusion = model_type == "diffusion_gemma"
    enc_scalars, dec_scalars = {}, {}
    for name, r in readers.items():
        for key in r.keys():
            kind, suffix = _classify(key, model_type)
            if kind == "encoder_scalar":
                enc_scalars[suffix] = (name, key)
            elif kind == "text" and suffix.endswith(".layer_scalar"):
                dec_scalars[suffix] = (name, key)
    if tie_layer_scalar is None:
        tie_layer_scalar = all(np.array_equal(readers[enc_scalars[s][0]].read(enc_scalars[s][1]),
                                              readers[f].read(k)) for s, (f, k) in dec_scalars.items()
                               if s in enc_scalars)
    overrides = dict(config_overrides)
    overrides.update({k: v for k, v in dict(dtype=dtype, param_dtype=param_dtype).items() if v is not None})
    cfg = model_config_from_hf(hf, str(path / "config.json"), tie_layer_scalar=tie_layer_scalar,
                               self_conditioning=True if self_conditioning is None else self_conditioning,
                               **overrides)
    # tensors are placed per layer (the key table's layout), then stacked if the model is scanned
    graphdef, abstract_state = nnx.split(abstract_model(cfg.with_execution(scan_layers=False)))
    if mesh is not None:
        shardings = state_shardings(abstract_state, mesh, get_rules(rules))
    else:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: dev, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    targets = {tuple(p): v for p, v in nnx.to_flat_state(abstract_state)}
    target_shardings = {tuple(p): s for p, s in nnx.to_flat_state(shardings)}
    values: dict[tuple, jax.Array] = {}
    report = ImportReport(model_type=model_type, files=sorted(readers))
    lm_head = None

    def place(dg_path, array, file, key):
        target = targets.get(dg_path)
        if target is None:
            raise CheckpointError(f"{file}: tensor {key!r} maps to dgemma parameter {_path_str(dg_path)} which this "
                                  f"model config does not have (config.json and weights disagree)")
        if tuple(array.shape) != tuple(target.shape):
            raise CheckpointError(f"{file}: tensor {key!r} -> {_path_str(dg_path)}: shape {list(array.shape)} in the "
                                  f"checkpoint but {list(target.shape)} expected from config.json")
        if dg_path in values:
            raise CheckpointError(f"{file}: tensor {key!r} fills {_path_str(dg_path)} a second time")
        values[dg_path] = jax.device_put(array.astype(target.dtype, copy=False), target_shardings[dg_path])

    for name, r in readers.items():
        file = path / name
        for key in r.keys():
            kind, suffix = _classify(key, model_type)
            if kind == "skip":
                report.skipped.append(key)
                continue
            if kind == "unexpected":
                raise CheckpointError(f"{file}: unexpected tensor {key!r} for a {model_type} checkpoint")
            src_dtype = r.dtype(key)
            if not np.issubdtype(src_dtype, np.floating) and src_dtype.name not in ("bfloat16",):
                raise CheckpointError(f"{file}: tensor {key!r} has dtype {src_dtype}, expected a floating dtype")
            if kind == "lm_head":
                lm_head = (file, key, r)  # compared block-wise after the embedding is placed
                continue
            if kind == "encoder_scalar":
                layer = int(suffix.split(".")[1])
                dg = ("layers", layer, "layer_scalar")
                place(dg, r.read(key), file, key)
                report.loaded += 1
                continue
            if keymap.kv_shared_unused(cfg, suffix):  # a KV-shared layer's own K/V: transformers ignores it too
                report.skipped.append(key)
                continue
            found = keymap.match(suffix)
            if found is None:
                raise CheckpointError(f"{file}: unexpected tensor {key!r} (no dgemma parameter matches "
                                      f"{suffix!r})")
            rule, dg_paths = found
            if suffix.endswith(".layer_scalar") and is_diffusion:
                # the decoder copy: its own parameter when untied; must equal the encoder copy when tied
                layer = int(suffix.split(".")[1])
                if not cfg.tie_layer_scalar:
                    dg_paths = [("layers", layer, "decoder_layer_scalar")]
                else:
                    continue  # identical to the encoder copy (checked when deciding tie_layer_scalar)
            if dg_paths[0][0] == "self_conditioning" and not cfg.self_conditioning:
                report.skipped.append(key)
                continue
            array = r.read(key)
            report.bytes_loaded += array.nbytes
            bad = [_path_str(p) for p in dg_paths if p not in targets]
            if bad:
                raise CheckpointError(f"{file}: tensor {key!r} maps to {bad}, which this model config does not have "
                                      "(config.json and weights disagree)")
            shapes = [tuple(targets[p].shape) for p in dg_paths]
            try:
                parts = rule.to_dgemma(array, shapes)
            except ValueError as e:
                raise CheckpointError(f"{file}: tensor {key!r} has shape {list(array.shape)}, incompatible with "
                                      f"{[_path_str(p) for p in dg_paths]} of shapes {[list(s) for s in shapes]} "
                                      f"({e})") from None
            del array  # the conversion made its own copies; free the read buffer before placing
            for p, part in zip(dg_paths, parts):
                place(p, part, file, key)
            report.loaded += 1
            del parts

    if report.skipped:
        log.info("skipped %d tensors (vision/audio towers, K/V of KV-shared layers), e.g. %s", len(report.skipped),
                 report.skipped[0])
    _fill_missing(cfg, targets, target_shardings, values, report, is_diffusion, sc_init_std, seed)
    missing = sorted(_path_str(p) for p in targets if p not in values)
    if missing:
        raise CheckpointError(f"{path}: checkpoint is missing tensors for {len(missing)} dgemma parameters, e.g. "
                              f"{missing[:6]}")
    if lm_head is not None:
        _check_tied_head(*lm_head, values[("embedder", "embedding")])
    state = nnx.from_flat_state([(p, targets[p].replace(values[p])) for p in targets])
    model = nnx.merge(graphdef, state)
    if cfg.execution.scan_layers:
        model = _to_scanned(cfg, model, mesh, rules)
    return model, report


def _to_scanned(cfg: ModelConfig, model, mesh, rules):
    """The per-layer model restacked into `cfg`'s scanned layout on the same kind of shardings."""
    graphdef, abstract = nnx.split(abstract_model(cfg))
    if mesh is not None:
        shardings = dict(nnx.to_flat_state(state_shardings(abstract, mesh, get_rules(rules))))
    else:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = {tuple(p): dev for p, _ in nnx.to_flat_state(abstract)}
    per_layer = {tuple(p): v[...] for p, v in nnx.to_flat_state(nnx.state(model))}
    stacked = keymap.scanned_params(cfg, per_layer)
    del model, per_layer
    state = nnx.from_flat_state([(p, v.replace(jax.device_put(stacked.pop(tuple(p)), shardings[tuple(p)])))
                                 for p, v in nnx.to_flat_state(abstract)])
    return nnx.merge(graphdef, state)


def _check_tied_head(file, key, reader, embedding, rows: int = 8192):
    """A stored lm_head must equal the embedding (Gemma 4 ties them); compared in row blocks to bound memory."""
    if tuple(reader.shape(key)) != tuple(embedding.shape):
        raise CheckpointError(f"{file}: tensor {key!r} has shape {list(reader.shape(key))} but the embedding is "
                              f"{list(embedding.shape)}; dgemma requires a tied LM head (Gemma 4)")
    head = reader.read(key)
    for start in range(0, head.shape[0], rows):
        a = head[start:start + rows].astype(np.float32)
        b = np.asarray(jax.device_get(embedding[start:start + rows]), np.float32)
        if not np.allclose(a, b):
            raise CheckpointError(f"{file}: tensor {key!r} differs from the embedding (rows {start}..); dgemma "
                                  "requires a tied LM head (Gemma 4)")


def _fill_missing(cfg: ModelConfig, targets, shardings, values, report, is_diffusion, sc_std, seed):
    """AR -> DiffusionGemma rule for what an AR checkpoint lacks (module docstring)."""
    for i in range(cfg.num_hidden_layers):
        dec = ("layers", i, "decoder_layer_scalar")
        if dec in targets and dec not in values and not is_diffusion:
            values[dec] = values[("layers", i, "layer_scalar")]
            report.initialised.append(".".join(map(str, dec)))
    if is_diffusion or not cfg.self_conditioning:
        return
    key = jax.random.key(seed)
    for p in sorted(p for p in targets if p[0] == "self_conditioning"):
        if p in values:
            continue
        t = targets[p]
        if p[-1] == "scale":
            arr = jnp.ones(t.shape, t.dtype)
        else:
            key, sub = jax.random.split(key)
            arr = (sc_std * jax.random.normal(sub, t.shape, jnp.float32)).astype(t.dtype)
        values[p] = jax.device_put(arr, shardings[p])
        report.initialised.append(_path_str(p))
