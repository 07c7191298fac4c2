"""Serialized compiled-function artifacts (`jax.export`): ship a jitted sampler step, reload it anywhere.

    fn, params = denoise_step(model, max_steps=48, t_min=0.4, t_max=0.8, entropy_bound=0.1)
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

`denoise_step` is one decoder forward plus the entropy-bounded accept / renoise update of diffusiongemma.md §5.2
steps 4.2-4.7 (temperature schedule, categorical sample, argmax, entropies, accept the lowest-entropy prefix whose
strictly-lower cumulative entropy is <= gamma, renoise the rest). Stop tests and row freezing belong to the sampler
loop (`dgemma.inference.sampler`); any jitted sampler function exports the same way.
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


def denoise_step(model, *, max_steps: int = 48, t_min: float = 0.4, t_max: float = 0.8, entropy_bound: float = 0.1):
    """(fn, params): fn(params, canvas [B,L] i32, cache dict, sc_logits [B,L,V] f32, has_sc [B] bool, step [] i32,
    key u32[2]) -> {canvas, argmax, logits, sc_logits, entropy_mean, accepted}. `step` counts N..1 as in HF."""
    from dgemma.model.cache import KVCache

    def step_fn(m, canvas, cache, sc_logits, has_sc, step, key):
        kv = KVCache(tuple(cache["keys"]), tuple(cache["values"]), cache["valid"], cache["length"])
        logits = m.logits(m.decode(canvas, kv, sc_logits=sc_logits, sc_mask=has_sc))  # fp32, soft-capped
        tau = jnp.float32(t_min) + jnp.float32(t_max - t_min) * (step.astype(jnp.float32) / jnp.float32(max_steps))
        z = logits / tau
        k_sample, k_noise = jax.random.split(jax.random.wrap_key_data(key))
        sampled = jax.random.categorical(k_sample, z, axis=-1).astype(jnp.int32)
        argmax = jnp.argmax(z, axis=-1).astype(jnp.int32)
        logp = jax.nn.log_softmax(z, axis=-1)
        entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)  # [B, L] nats
        order = jnp.argsort(entropy, axis=-1)
        h_sorted = jnp.take_along_axis(entropy, order, axis=-1)
        ok_sorted = (jnp.cumsum(h_sorted, axis=-1) - h_sorted) <= entropy_bound
        accepted = jnp.zeros_like(ok_sorted).at[jnp.arange(canvas.shape[0])[:, None], order].set(ok_sorted)
        noise = jax.random.randint(k_noise, canvas.shape, 0, m.cfg.vocab_size, jnp.int32)
        return {"canvas": jnp.where(accepted, sampled, noise), "argmax": argmax, "logits": logits, "sc_logits": z,
                "entropy_mean": jnp.mean(entropy, axis=-1), "accepted": accepted}

    return model_fn(model, step_fn)


def example_step_inputs(model, batch: int, prompt_len: int, *, seed: int = 0):
    """Concrete inputs for `denoise_step` (a random prompt encoded into a fresh cache) for tracing and tests."""
    from dgemma.model.cache import KVCache

    cfg = model.cfg
    key = jax.random.key(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    prompt = jax.random.randint(k1, (batch, prompt_len), 3, cfg.vocab_size, jnp.int32)
    _, cache = model.encode(prompt, KVCache.init(cfg, batch, prompt_len + cfg.canvas_length))
    canvas = jax.random.randint(k2, (batch, cfg.canvas_length), 0, cfg.vocab_size, jnp.int32)
    sc = jnp.zeros((batch, cfg.canvas_length, cfg.vocab_size), jnp.float32)
    return (canvas, cache_to_dict(cache), sc, jnp.zeros((batch,), bool), jnp.int32(cfg.canvas_length),
            jax.random.key_data(k3))


def to_numpy_leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]
