"""Export a dgemma `Transformer` to Hugging Face safetensors: `diffusion_gemma`, or plain Gemma 4 for AR serving.

    export_hf(model, "out/dir", layout="diffusion_gemma")     # DiffusionGemmaForBlockDiffusion
    export_hf(model, "out/dir", layout="gemma4_text")         # Gemma4ForCausalLM   (keys model.*)
    export_hf(model, "out/dir", layout="gemma4")              # Gemma4ForConditionalGeneration (model.language_model.*)
    export_hf(model, d, vision_source="hf/ckpt")              # + vision tower copied byte-identically from a HF ckpt
    export_hf(model, d, quantization="fp8")                   # FineGrainedFP8 e4m3 block-scaled linears (fp8.py)
    export_from_params(params_state, model_cfg, d, ...)       # from a restored params-only checkpoint

config.json and generation_config.json are produced by transformers' own classes (`DiffusionGemmaConfig` and
`DiffusionGemmaGenerationConfig`, built in hf_config.py; `FineGrainedFP8Config`, fp8.py), so their keys are exactly
what transformers serialises; the text config is derived from the model config, the sampler settings from
`generation_config` (a `SamplerSection` or a dict; defaults = `_get_default_generation_params`). diffusion_gemma
layout (as transformers' DiffusionGemma checkpoints): text weights under `model.decoder.*` (the tie targets), the self-conditioning MLP,
and `layer_scalar` twice (decoder copy + `model.encoder.language_model.layers.N.layer_scalar`); lm_head and encoder
text weights are tied, never stored. `vision_source` copies `{model.,model.encoder.}{vision_tower,embed_vision}.*`
tensors byte for byte, renamed to the target layout, and takes `vision_config` and the image/boi/eoi ids from its
config.json. Without one, a diffusion_gemma export carries the null vision tower (`NULL_VISION_CONFIG`): transformers'
DiffusionGemma always builds a vision tower (`DiffusionGemmaConfig(vision_config=None)` fills in a 16-layer default,
loaded as random weights reported missing), so a text-only export declares a 0-layer, width-1 Gemma 4 vision tower
and writes its three tensors as zeros (H + 5 values): transformers loads it with no missing or unexpected keys, and
the model stays text-only (an image would embed to zero vectors).

Streaming: shards are planned from shapes alone; each shard's header is written, then every tensor is fetched,
converted and appended one at a time (sha256 on the fly): the host holds about one tensor beyond the model.
Safety: files go to `.<name>.tmp-<pid>-<id>/` beside the destination, are fsynced, and the directory is renamed into
place only when complete, so an interrupted export leaves no destination (the next export removes temp dirs of dead
pids). An existing destination needs `overwrite=True` and is swapped out by rename, deleted only after the new one
is in place. Each file's size and sha256 go into `dgemma_manifest.json`; `verify(dir)` checks them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from dgemma.convert import diffusers_layout, fp8, keymap, tokenizer_files
from dgemma.convert.destination import check_destination, sha256_file, write_export_dir
from dgemma.convert.hf_config import hf_config, hf_generation_config, read_config_json
from dgemma.convert.safetensors_io import DTYPE_NAMES, SafetensorsFile, checkpoint_files
from dgemma.model.config import ModelConfig

log = logging.getLogger(__name__)
LAYOUTS = ("diffusion_gemma", "gemma4_text", "gemma4", "diffusers")  # diffusers: diffusion_gemma in a pipeline repo
TEXT_PREFIX = {"diffusion_gemma": "model.decoder.", "gemma4_text": "model.", "gemma4": "model.language_model."}
ARCHITECTURE = {"diffusion_gemma": "DiffusionGemmaForBlockDiffusion", "gemma4_text": "Gemma4ForCausalLM",
                "gemma4": "Gemma4ForConditionalGeneration"}
VISION_BASE = {"diffusion_gemma": "model.encoder.", "gemma4": "model."}  # + vision_tower. / embed_vision.
MM_TOKEN_IDS = {"diffusion_gemma": ("image_token_id", "boi_token_id", "eoi_token_id"),
                "gemma4": ("image_token_id", "boi_token_id", "eoi_token_id", "video_token_id")}
MANIFEST = "dgemma_manifest.json"
NP_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32),
             "float16": np.dtype(np.float16)}
_SHAPE_ONLY = np.dtype([])  # zero-byte items: run keymap rules on shapes without allocating
NULL_VISION_CONFIG: dict[str, Any] = dict(
    model_type="gemma4_vision", hidden_size=1, intermediate_size=1, num_hidden_layers=0, num_attention_heads=1,
    num_key_value_heads=1, head_dim=1, global_head_dim=1, patch_size=1, position_embedding_size=1)
"""The smallest vision config transformers' Gemma4VisionModel builds: no encoder layers, so its only weights are the
patch embedder's (`null_vision_groups`)."""


# MARK: tensor plan ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Group:
    """Tensors produced together (a weight and its FP8 scale, or a split expert): `entries` [(key, shape, dtype)]
    in file order; `produce()` -> {key: array}. A group never straddles two shards."""

    entries: list[tuple[str, tuple[int, ...], np.dtype]]
    produce: Callable[[], dict[str, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(s, dtype=np.int64)) * d.itemsize for _, s, d in self.entries)


def text_groups(model, layout: str, dtype: np.dtype, quant: dict | None = None) -> list[Group]:
    """Plan every text tensor of the layout; arrays are fetched from the devices only when a group is produced."""
    cfg: ModelConfig = model.cfg
    flat = keymap.per_layer_params(cfg, {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))})
    prefix = TEXT_PREFIX[layout]
    suffixes = keymap.hf_text_suffixes(cfg)
    if layout == "diffusion_gemma":
        if model.self_conditioning is None:
            raise ValueError("layout 'diffusion_gemma' needs the self-conditioning module (cfg.self_conditioning)")
        suffixes = suffixes + keymap.self_conditioning_suffixes()
    pairs = []
    for suffix in suffixes:
        found = keymap.match(suffix)
        assert found is not None  # hf_text_suffixes lists only suffixes a keymap rule matches
        rule, paths = found
        if suffix.endswith("layer_scalar") and layout == "diffusion_gemma" and not cfg.tie_layer_scalar:
            paths = [paths[0][:-1] + ("decoder_layer_scalar",)]
        pairs.append((prefix + suffix, suffix, rule.to_hf, paths))
    if layout == "diffusion_gemma":
        pairs += [(f"model.encoder.language_model.layers.{i}.layer_scalar", "layer_scalar", lambda a: a[0],
                   [("layers", i, "layer_scalar")]) for i in range(cfg.num_hidden_layers)]
    return [_text_group(key, suffix, to_hf, [flat[p] for p in paths], dtype, quant)
            for key, suffix, to_hf, paths in pairs]


def _text_group(key, suffix, to_hf, variables, dtype, quant) -> Group:
    shape = tuple(to_hf([np.empty(v.shape, _SHAPE_ONLY) for v in variables]).shape)

    def fetch():  # native dtype (no fp32 detour): rules are transposes/reshapes/concats
        return to_hf([np.asarray(jax.device_get(v[...])) for v in variables])

    if quant is None or not fp8.is_quantised(suffix):
        return Group([(key, shape, dtype)], lambda: {key: fetch().astype(dtype, copy=False)})
    block, per_expert = quant["block"], quant["expert_layout"] == "per_expert"
    if per_expert and ".experts." in key:
        split = fp8.per_expert_split(key, np.empty(shape, _SHAPE_ONLY))
        entries = []
        for k, a in split.items():
            entries += [(k, a.shape, fp8.FP8), (fp8.scale_key(k), fp8.scale_shape(k, a.shape, block), np.dtype("f4"))]

        def produce():
            out = {}
            for k, a in fp8.per_expert_split(key, fetch()).items():
                out.update(fp8.quantize_tensor(k, a, block))
            return out

        return Group(entries, produce)
    entries = [(key, shape, fp8.FP8), (fp8.scale_key(key), fp8.scale_shape(key, shape, block), np.dtype("f4"))]
    return Group(entries, lambda: fp8.quantize_tensor(key, fetch(), block))


def vision_groups(source, layout: str) -> tuple[list[Group], dict, dict]:
    """Vision tensors of a HF checkpoint, renamed to `layout`, bytes unchanged -> (groups, vision_config, token ids)."""
    if layout not in VISION_BASE:
        raise ValueError(f"vision_source: layout {layout!r} has no vision tower (use 'diffusion_gemma' or 'gemma4')")
    source = Path(source)
    hf = read_config_json(source)
    src_base = VISION_BASE.get(hf.get("model_type", ""))
    if src_base is None or not isinstance(hf.get("vision_config"), dict):
        raise ValueError(f"vision_source {source}: model_type {hf.get('model_type')!r} with vision_config expected "
                         f"(a 'diffusion_gemma' or 'gemma4' checkpoint)")
    heads = (src_base + "vision_tower.", src_base + "embed_vision.")
    groups = []
    for name in checkpoint_files(source):
        reader = SafetensorsFile(source / name)
        for key in reader.keys():
            if key.startswith(heads):
                new = VISION_BASE[layout] + key[len(src_base):]
                groups.append(Group([(new, reader.shape(key), reader.dtype(key))], _read_renamed(reader, key, new)))
    if not groups:
        raise ValueError(f"vision_source {source}: no tensors under {heads}")
    ids = {k: hf[k] for k in MM_TOKEN_IDS[layout] if hf.get(k) is not None}
    return sorted(groups, key=lambda g: g.entries[0][0]), hf["vision_config"], ids


def null_vision_groups(cfg: ModelConfig, dtype: np.dtype) -> list[Group]:
    """The null vision tower of a text-only diffusion_gemma export (`NULL_VISION_CONFIG`): every tensor
    `DiffusionGemmaEncoderModel` builds for it, zero-filled, in the export's dtype."""
    base, width = VISION_BASE["diffusion_gemma"], NULL_VISION_CONFIG["hidden_size"]
    patch = NULL_VISION_CONFIG["patch_size"]
    shapes = {base + "embed_vision.embedding_projection.weight": (cfg.hidden_size, width),
              base + "vision_tower.patch_embedder.input_proj.weight": (width, 3 * patch * patch),
              base + "vision_tower.patch_embedder.position_embedding_table":
                  (2, NULL_VISION_CONFIG["position_embedding_size"], width)}
    return [Group([(k, s, dtype)], _zeros(k, s, dtype)) for k, s in sorted(shapes.items())]


def _read_renamed(reader: SafetensorsFile, key: str, new: str) -> Callable[[], dict[str, np.ndarray]]:
    """`produce` of a tensor copied under a new name: () -> {new: the tensor `key` of `reader`}."""
    return lambda: {new: reader.read(key)}


def _zeros(key: str, shape: tuple[int, ...], dtype: np.dtype) -> Callable[[], dict[str, np.ndarray]]:
    """`produce` of a zero-filled tensor: () -> {key: zeros}."""
    return lambda: {key: np.zeros(shape, dtype)}


# MARK: streaming writer -----------------------------------------------------------------------------------------


class _HashingFile:
    def __init__(self, path: Path):
        self.path, self.f, self.h, self.size = path, open(path, "wb"), hashlib.sha256(), 0

    def write(self, data) -> None:
        try:
            self.f.write(data)
        except OSError as e:  # a failed write's error names no file (a full disk): name it
            raise OSError(e.errno, e.strerror, str(self.path)) from e
        self.h.update(data)
        self.size += len(data)

    def close(self) -> dict:
        try:
            self.f.flush()
            os.fsync(self.f.fileno())
        except OSError as e:
            with contextlib.suppress(OSError):  # closing flushes the same unwritten bytes again
                self.f.close()
            raise OSError(e.errno, e.strerror, str(self.path)) from e
        self.f.close()
        return {"bytes": self.size, "sha256": self.h.hexdigest()}


def _header(entries) -> bytes:
    """safetensors header exactly as `safetensors_io.write_safetensors` writes it (8-byte aligned with spaces)."""
    header, offset = {}, 0
    for key, shape, dtype in entries:
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[key] = {"dtype": DTYPE_NAMES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    return len(raw + b" " * (-len(raw) % 8)).to_bytes(8, "little") + raw + b" " * (-len(raw) % 8)


def write_shards(tmp: Path, groups: list[Group], max_shard_bytes: int, on_shard=None) -> dict[str, dict]:
    """Stream the groups into `model[-0000k-of-0000n].safetensors` (+ index). Returns {file: {bytes, sha256}}."""
    shards: list[list[Group]] = [[]]
    size = 0
    for g in groups:
        if shards[-1] and size + g.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(g)
        size += g.nbytes
    n = len(shards)
    names = [f"model-{i:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors" for i in range(1, n + 1)]
    files, weight_map = {}, {}
    for name, shard in zip(names, shards):
        entries = [e for g in shard for e in g.entries]
        out = _HashingFile(tmp / name)
        out.write(_header(entries))
        for g in shard:
            arrays = g.produce()
            for key, shape, dtype in g.entries:
                a = arrays.pop(key)
                if tuple(a.shape) != tuple(shape) or a.dtype != dtype:
                    raise AssertionError(f"export plan mismatch for {key}: {a.shape} {a.dtype} vs {shape} {dtype}")
                out.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)
                weight_map[key] = name
            del arrays
        files[name] = out.close()
        if on_shard is not None:
            on_shard(name)
    if n > 1:
        total = sum(g.nbytes for g in groups)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files


# MARK: export ---------------------------------------------------------------------------------------------------


def export_hf(model, out_dir, *, layout: str = "diffusion_gemma", dtype: str = "bfloat16",
              max_shard_size: int = 5 * 1024**3, overwrite: bool = False, vision_config: dict | None = None,
              vision_source=None, generation_config=None, tokenizer_dir=None, extra_files: dict | None = None,
              quantization: str | None = None, fp8_block_size: tuple[int, int] | None = None,
              allow_partial_fp8_blocks: bool = False, expert_layout: str = "fused",
              on_shard: Callable[[str], None] | None = None, sources=()) -> Path:
    """Write `model` as a HF checkpoint directory; returns the destination path.

    dtype: storage dtype of every unquantised text tensor (vision tensors keep the source's bytes).
    generation_config: sampler settings (`SamplerSection`, dict, or a ready transformers GenerationConfig).
    quantization: None or "fp8" (see `dgemma.convert.fp8`); on_shard(name): called after each shard is complete.
    fp8_block_size: (bn, bk); None: the largest square block dividing every quantised dimension (64 for 26B-A4B,
      whose I = 2112 and I_moe = 704 are not multiples of 128), so vLLM's block-FP8 loader accepts the export. A
      block that leaves partial edge blocks is refused unless `allow_partial_fp8_blocks`.
    overwrite: replace an existing `out_dir`, which must be a previous export (has the manifest); `sources` (input
      paths) may never lie inside `out_dir`. SIGTERM while writing removes the temporary directory.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"export layout {layout!r} is not one of {LAYOUTS}")
    if dtype not in NP_DTYPES:
        raise ValueError(f"export dtype {dtype!r} is not one of {sorted(NP_DTYPES)}")
    if quantization not in (None, "fp8") or expert_layout not in fp8.EXPERT_LAYOUTS:
        raise ValueError(f"quantization {quantization!r} / expert_layout {expert_layout!r} not supported "
                         f"(None | 'fp8'; {fp8.EXPERT_LAYOUTS})")
    if max_shard_size <= 0:
        raise ValueError(f"max_shard_size must be > 0 bytes, got {max_shard_size}")
    if tokenizer_dir is not None:
        tokenizer_files.tokenizer_files(tokenizer_dir)  # refused before anything is written
    pipeline = layout == "diffusers"
    if pipeline:  # the model is a diffusion_gemma export in the repository's model/ folder
        diffusers_layout.check_tokenizer(tokenizer_dir)
        layout = "diffusion_gemma"
    out = Path(out_dir)
    check_destination(out, overwrite=overwrite, kind="export", sources=sources)
    groups: list[Group] = []
    ids: dict[str, Any] = {}  # the vision tower's multimodal token ids
    if vision_source is not None:
        if vision_config is not None:
            raise ValueError("pass vision_config or vision_source, not both (vision_source carries its own)")
        groups, vision_config, ids = vision_groups(vision_source, layout)
    elif layout == "diffusion_gemma" and vision_config is None:
        groups, vision_config = null_vision_groups(model.cfg, NP_DTYPES[dtype]), dict(NULL_VISION_CONFIG)
    quant: dict[str, Any] | None = None
    if quantization is not None:
        block = tuple(fp8_block_size) if fp8_block_size is not None else _auto_fp8_block(model, layout)
        if len(block) != 2 or min(block) <= 0:
            raise ValueError(f"fp8 block size must be two positive ints, got {block}")
        quant = {"block": block, "expert_layout": expert_layout}
    has_vision = bool(groups)
    groups = text_groups(model, layout, NP_DTYPES[dtype], quant) + groups
    conf = hf_config(model.cfg, layout, vision_config, ids)
    conf.dtype = dtype
    conf.architectures = [ARCHITECTURE[layout]]
    if quant is not None:
        conf.quantization_config = fp8.quantization_config(layout, quant["block"], has_vision)
        partial = fp8.block_mismatches({k: s for g in groups for k, s, d in g.entries if d == fp8.FP8}, quant["block"])
        if partial and not allow_partial_fp8_blocks:
            raise ValueError(f"fp8 block {list(quant['block'])} leaves partial blocks in {len(partial)} tensors (e.g. "
                             f"{partial[0]}): vLLM's block-FP8 loader rejects that; use a block dividing every "
                             f"quantised dimension (default: chosen automatically) or allow partial blocks explicitly")
        if partial:
            log.warning("fp8 block %s leaves partial blocks in %d tensors (e.g. %s): transformers' GPU kernels accept "
                        "them, vLLM's block-FP8 checks and transformers' CPU dequantisation do not",
                        quant["block"], len(partial), partial[0])
    gen = generation_config
    if gen is None or dataclasses.is_dataclass(gen) or isinstance(gen, dict):
        tokenizer_ids = tokenizer_files.special_ids(tokenizer_dir) if tokenizer_dir is not None else None
        gen = hf_generation_config(model.cfg, layout, gen, tokenizer_ids=tokenizer_ids)

    _write(out, groups, conf, gen, "diffusers" if pipeline else layout, dtype, quantization, max_shard_size,
           tokenizer_dir, extra_files, on_shard, overwrite, sources)
    return out


def _auto_fp8_block(model, layout: str) -> tuple[int, int]:
    """The largest square block (128, 64, 32, 16, else the gcd) dividing both edges of every quantised tensor."""
    shapes = [s for g in text_groups(model, layout, _SHAPE_ONLY) for k, s, _ in g.entries
              if k.startswith(TEXT_PREFIX[layout]) and fp8.is_quantised(k[len(TEXT_PREFIX[layout]):])]
    edge = fp8.suggest_block(sorted({d for s in shapes for d in s[-2:]}))
    return edge, edge


def _write(out, groups, conf, gen, layout, dtype, quantization, max_shard_size, tokenizer_dir, extra_files,
           on_shard, overwrite, sources) -> None:
    def fill(tmp: Path) -> dict:
        model_dir = tmp
        if layout == "diffusers":  # tokenizer in processor/, not beside the weights
            model_dir = tmp / diffusers_layout.MODEL
            model_dir.mkdir()
            diffusers_layout.write_pipeline_files(tmp, gen, tokenizer_dir)
        elif tokenizer_dir is not None:
            tokenizer_files.copy_tokenizer(tokenizer_dir, tmp)
        files = {str((model_dir / n).relative_to(tmp)): meta
                 for n, meta in write_shards(model_dir, groups, max_shard_size, on_shard).items()}
        conf.save_pretrained(model_dir)
        gen.save_pretrained(model_dir)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        for p in sorted(tmp.rglob("*")):  # files in sub-folders (write_export_dir hashes the top level's)
            name = str(p.relative_to(tmp))
            if p.is_file() and p.parent != tmp and name not in files:
                files[name] = {"bytes": p.stat().st_size, "sha256": sha256_file(p, fsync=True)}
        return files

    write_export_dir(out, fill, {"layout": layout, "dtype": dtype, "quantization": quantization},
                     overwrite=overwrite, sources=sources)


def export_from_params(params_state, model_cfg: ModelConfig, out_dir, **kwargs) -> Path:
    """Export a params-only checkpoint: `params_state` is an `nnx.State` of the model's Params or its pure nested
    dict (`CheckpointManager.restore_params` output); merged into an abstract graphdef, nothing else is allocated."""
    from dgemma.model.transformer import abstract_model

    graphdef, abstract = nnx.split(abstract_model(model_cfg), nnx.Param)
    if not isinstance(params_state, nnx.State):
        state = jax.tree.map(lambda x: x, abstract)
        nnx.replace_by_pure_dict(state, params_state)
        params_state = state
    return export_hf(nnx.merge(graphdef, params_state), out_dir, **kwargs)


def verify(directory) -> dict:
    """Check every file listed in `dgemma_manifest.json` (size, sha256); raise ValueError naming the first mismatch.
    Files not in the manifest (a model hub adds README.md, .gitattributes) are allowed: they are returned under the
    manifest's "unlisted" key and logged, never read as weights by the importer. Returns the manifest."""
    d = Path(directory)
    manifest = json.loads((d / MANIFEST).read_text())
    for name, meta in manifest["files"].items():
        p = d / name
        if not p.exists():
            raise ValueError(f"{p}: listed in {MANIFEST} but missing")
        if p.stat().st_size != meta["bytes"] or sha256_file(p) != meta["sha256"]:
            raise ValueError(f"{p}: size/sha256 differ from {MANIFEST} (file modified or corrupt)")
    extra = sorted(p.name for p in d.iterdir() if p.is_file() and p.name != MANIFEST and p.name not in manifest["files"])
    if extra:
        log.info("%s: files not in %s (ignored): %s", d, MANIFEST, extra)
    manifest["unlisted"] = extra
    return manifest


verify_manifest = verify  # earlier name
