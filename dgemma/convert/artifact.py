"""Serialized compiled-function artifacts (`jax.export`): ship a jitted sampler step, reload it anywhere.

    fn, params = denoise_step(model, SamplerConfig(max_steps=48, entropy_bound=0.1))
    exported = export_fn(fn, params, *example_inputs, platforms=("cpu", "cuda"))
    save_artifact(exported, "out/step_artifact", metadata={...})
    art = load_artifact("out/step_artifact")           # a fresh process needs jax only, not the model code
    outputs = art.call(params, *inputs)                # or art.call_flat(leaves) with leaves in `in_tree` order

Any function of (params, inputs) can be exported: pytrees of dicts / lists / tuples of arrays. `model_fn` turns an
NNX model method into such a function, with the weights as a flat `{"layers.0.attn.q_proj": array}` dict (not
baked into the artifact, so one artifact serves every checkpoint of the same architecture and shapes). One
`Exported` holds StableHLO for every requested platform; `jax.export.serialize` bytes go to `function.jaxexport`,
described by `artifact.json` (platforms, jax version, input/output avals, caller metadata), and every file's size
and sha256 to `dgemma_manifest.json` (same format and `verify` as HF exports). Saving is atomic (temp dir + rename).

`denoise_step` is one step of the block sampler: the decoder forward, then the sampler's own per-step function
(`dgemma.inference.eb_accept.eb_denoise_step`: temperature, draws, accept / renoise, freeze, stop test), so a loop
of the artifact decodes a block exactly as `dgemma.inference.sampler` does; any jitted sampler function (e.g.
`dgemma.inference.sampler.block_function`, a whole block) exports the same way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

FORMAT = "dgemma-jax-export/1"
FUNCTION_FILE = "function.jaxexport"
INFO_FILE = "artifact.json"
MANIFEST = "dgemma_manifest.json"


def export_fn(fn, *example_args, platforms=("cpu", "cuda")) -> jax.export.Exported:
    """`jax.export` of `fn` (jitted here unless it already is) for `platforms`, traced at `example_args`
    (arrays or `jax.ShapeDtypeStruct`s)."""
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    return jax.export.export(jitted, platforms=tuple(platforms))(*example_args)


def save_artifact(exported: jax.export.Exported, out_dir, *, metadata: dict | None = None,
                  overwrite: bool = False) -> Path:
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=True to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        blob = bytes(exported.serialize())
        (tmp / FUNCTION_FILE).write_bytes(blob)
        info = {"format": FORMAT, "function": exported.fun_name, "platforms": list(exported.platforms),
                "jax_version": jax.__version__, "in_avals": [str(a) for a in exported.in_avals],
                "out_avals": [str(a) for a in exported.out_avals], "metadata": metadata or {}}
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        files = {p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                 for p in sorted(tmp.iterdir())}
        (tmp / MANIFEST).write_text(json.dumps({"kind": "jax_export", "files": files}, indent=2, sort_keys=True)
                                    + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


@dataclasses.dataclass
class Artifact:
    exported: jax.export.Exported
    info: dict

    def call(self, *args):
        return self.exported.call(*args)

    def call_flat(self, leaves):
        """Call with the input leaves in `exported.in_tree` order (a caller that does not know the structure)."""
        args, kwargs = jax.tree.unflatten(self.exported.in_tree, list(leaves))
        return self.exported.call(*args, **kwargs)


def load_artifact(path, *, verify: bool = True) -> Artifact:
    d = Path(path)
    if verify:
        manifest = json.loads((d / MANIFEST).read_text())
        for name, meta in manifest["files"].items():
            data = (d / name).read_bytes()
            if len(data) != meta["bytes"] or hashlib.sha256(data).hexdigest() != meta["sha256"]:
                raise ValueError(f"{d / name}: size/sha256 differ from {MANIFEST} (file modified or corrupt)")
    info = json.loads((d / INFO_FILE).read_text())
    if info.get("format") != FORMAT:
        raise ValueError(f"{d / INFO_FILE}: format {info.get('format')!r}, expected {FORMAT!r}")
    return Artifact(jax.export.deserialize(bytearray((d / FUNCTION_FILE).read_bytes())), info)


# MARK: NNX models as functions of (params, inputs) ---------------------------------------------------------------


def params_dict(model) -> dict[str, jax.Array]:
    """{"layers.0.attn.q_proj": array} of the model's Params (the artifact's weight argument)."""
    from flax import nnx

    return {".".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def model_fn(model, f):
    """g(params_dict, *inputs) = f(model rebuilt from params_dict, *inputs); returns (g, params_dict(model))."""
    from flax import nnx

    graphdef, state = nnx.split(model, nnx.Param)
    paths = {".".join(map(str, p)): (tuple(p), v) for p, v in nnx.to_flat_state(state)}

    def g(params, *inputs):
        flat = [(path, var.replace(params[name])) for name, (path, var) in paths.items()]
        return f(nnx.merge(graphdef, nnx.from_flat_state(flat)), *inputs)

    return g, params_dict(model)


def cache_to_dict(cache) -> dict:
    return {"keys": tuple(cache.keys), "values": tuple(cache.values), "valid": cache.valid, "length": cache.length}


def denoise_step(model, scfg):
    """(fn, params): one step of the block sampler exactly as `dgemma.inference.sampler` runs it for EB diffusion
    (settings `scfg`, a `SamplerConfig`, baked in): the self-conditioned decoder forward, then
    `dgemma.inference.eb_accept.eb_denoise_step` (temperature, proposal and renoise draws, accept / freeze / stop: the
    sampler's own step function), then the sampler's self-conditioning update (rows already done keep theirs).

    fn(params, canvas [B, L] i32, cache dict, soft_embeds [B, L, H] (zeros before the first step), draft [B, L] i32,
    done [B] bool, history [max(S, 1), B, L] i32 (init -1), step [] i32 (0-based loop index), block_keys u32[B, 2] (the
    rows' key data for this block)) -> {canvas, draft, done, history, soft_embeds, argmax, accepted, entropy_mean,
    logits, z}: the next loop state plus what the step computed. Loop it while step < max_steps and not all(done) to
    decode a block.
    """
    from dgemma.inference import eb_accept
    from dgemma.model.cache import KVCache

    if scfg.algorithm != "eb":
        raise ValueError(f"denoise_step: SamplerConfig.algorithm={scfg.algorithm!r}; the step artifact is the EB step")
    dyn = scfg.dynamic_part()
    cfg = model.cfg
    act_dtype, emb_dtype = jnp.dtype(cfg.execution.dtype), jnp.dtype(cfg.execution.param_dtype)

    def step_fn(m, canvas, cache, soft_embeds, draft, done, history, step, block_keys):
        kv = KVCache(tuple(cache["keys"]), tuple(cache["values"]), cache["valid"], cache["length"])
        logits = m.logits(m.decode(canvas, kv, soft_embeds=soft_embeds))  # fp32, soft-capped
        keys = jax.random.wrap_key_data(block_keys)
        step_keys = jax.vmap(jax.random.fold_in)(keys, jnp.broadcast_to((step + 1).astype(jnp.uint32), done.shape))
        _, z, _, dec = eb_accept.eb_denoise_step(
            logits, step_keys, step, canvas, draft, done, history, dyn, vocab_size=cfg.vocab_size,
            max_steps=scfg.max_steps, accept_rule=scfg.accept, greedy=scfg.greedy, sampling=scfg.sampling,
            stability=scfg.stability_threshold)
        new_soft = jnp.where(done[:, None, None], soft_embeds, m.soft_embed(z.astype(emb_dtype)).astype(act_dtype))
        return {"canvas": dec.canvas, "draft": dec.draft, "done": dec.done, "history": dec.history,
                "soft_embeds": new_soft, "argmax": dec.argmax, "accepted": dec.accept, "entropy_mean": dec.mean_entropy,
                "logits": logits, "z": z}

    return model_fn(model, step_fn)


def example_step_inputs(model, scfg, batch: int, prompt_len: int, *, seed: int = 0):
    """The inputs of `denoise_step` at the first step of a block, as the sampler starts it: a random prompt encoded
    into a fresh cache, the initial noise canvas drawn from the block key, zero self-conditioning (tracing, tests)."""
    from dgemma.model.cache import KVCache

    cfg = model.cfg
    L = cfg.canvas_length
    k1, k2 = jax.random.split(jax.random.key(seed))
    prompt = jax.random.randint(k1, (batch, prompt_len), 3, cfg.vocab_size, jnp.int32)
    _, cache = model.encode(prompt, KVCache.init(cfg, batch, prompt_len + L))
    block_keys = jax.random.split(k2, batch)
    canvas = jax.vmap(lambda k: jax.random.randint(jax.random.fold_in(k, 0), (L,), 0, cfg.vocab_size, jnp.int32))(
        block_keys)
    S = max(scfg.stability_threshold, 1)
    soft_embeds = jnp.zeros((batch, L, cfg.hidden_size), jnp.dtype(cfg.execution.dtype))
    return (canvas, cache_to_dict(cache), soft_embeds, canvas, jnp.zeros((batch,), bool),
            jnp.full((S, batch, L), -1, jnp.int32), jnp.int32(0), jax.random.key_data(block_keys))


def to_numpy_leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]
