"""jax.export artifact of the denoising step: exported for cpu and cuda, serialised, and reloaded in a FRESH process
(which imports jax and `dgemma.convert.artifact` only) producing the live function's tokens and logits exactly; a loop
of the step artifact decodes a block exactly as the sampler does (it runs the sampler's own step function)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import fast_xla

pytest.importorskip("flatbuffers", reason="jax.export serialisation needs the `flatbuffers` package")

from flax import nnx  # noqa: E402

from dgemma.convert import artifact as A  # noqa: E402
from dgemma.inference.sampler_types import SamplerConfig  # noqa: E402
from dgemma.model.config import tiny  # noqa: E402
from dgemma.model.transformer import Transformer  # noqa: E402

GAMMA = 12.0  # a bound large enough that the random tiny model accepts a varying prefix


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    model = Transformer(tiny(), rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)  # widen weights: sharper, less uniform logits
    nnx.update(model, jax.tree.map(lambda x: x * 8.0 if x.ndim > 1 else x, state))
    scfg = SamplerConfig(max_steps=6, entropy_bound=GAMMA)
    fn, params = A.denoise_step(model, scfg)
    inputs = A.example_step_inputs(model, scfg, batch=2, prompt_len=5, seed=1)
    exported = A.export_fn(fn, params, *inputs, platforms=("cpu", "cuda"))
    live = jax.jit(fn)(params, *inputs)
    d = tmp_path_factory.mktemp("artifact")
    path = A.save_artifact(exported, d / "step", metadata={"sampler": {"max_steps": 6, "entropy_bound": GAMMA}})
    return model, fn, params, inputs, exported, live, path


def test_exported_for_cpu_and_cuda(step):
    *_, exported, live, path = step
    assert exported.platforms == ("cpu", "cuda")
    info = json.loads((path / "artifact.json").read_text())
    assert info["platforms"] == ["cpu", "cuda"] and info["metadata"]["sampler"]["max_steps"] == 6
    again = jax.export.deserialize(bytearray((path / "function.jaxexport").read_bytes()))
    assert again.platforms == ("cpu", "cuda") and again.in_avals == exported.in_avals
    assert set(live) == {"canvas", "draft", "done", "history", "soft_embeds", "argmax", "accepted", "entropy_mean",
                         "logits", "z"}


def test_accept_rule_matches_reference(step):
    """Accept rank r iff the sum of strictly lower-ranked entropies <= gamma; the rest is renoised."""
    *_, live, _ = step
    z = np.asarray(live["z"], np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    h = -(p * np.log(np.where(p > 0, p, 1))).sum(-1)
    accepted = np.asarray(live["accepted"])
    for b in range(h.shape[0]):
        order = np.argsort(h[b], kind="stable")
        want = np.zeros_like(accepted[b])
        want[order] = (np.cumsum(h[b][order]) - h[b][order]) <= GAMMA
        np.testing.assert_array_equal(accepted[b], want)
    assert 0 < accepted.sum() < accepted.size  # a mix of accepted and renoised positions
    np.testing.assert_array_equal(np.asarray(live["argmax"]), np.asarray(live["z"]).argmax(-1))


def test_reload_in_fresh_process_matches_live(step, tmp_path):
    _, _, params, inputs, exported, live, path = step
    leaves = A.to_numpy_leaves(((params, *inputs), {}))
    assert len(leaves) == len(exported.in_avals)
    np.savez(tmp_path / "inputs.npz", *leaves)
    np.savez(tmp_path / "expected.npz", **{k: np.asarray(v) for k, v in live.items()})
    script = textwrap.dedent(f"""
        import sys, numpy as np
        from dgemma.convert.artifact import load_artifact
        art = load_artifact({str(path)!r})
        with np.load({str(tmp_path / 'inputs.npz')!r}) as f:
            leaves = [f[f"arr_{{i}}"] for i in range(len(f.files))]
        out = art.call_flat(leaves)
        exp = np.load({str(tmp_path / 'expected.npz')!r})
        for k in exp.files:
            np.testing.assert_array_equal(np.asarray(out[k]), exp[k], err_msg=k)
        assert "dgemma.model" not in " ".join(sys.modules), "the artifact must not need the model code"
        print("ARTIFACT_OK", int(exp["accepted"].sum()))
    """)
    env = {**os.environ, "XLA_FLAGS": fast_xla.xla_flags()}  # no forced device count: one device, as a server has
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ARTIFACT_OK" in res.stdout


def test_tampered_artifact_is_refused(step, tmp_path):
    *_, exported, _, _ = step
    p = A.save_artifact(exported, tmp_path / "a")
    data = bytearray((p / "function.jaxexport").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (p / "function.jaxexport").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256 differ"):
        A.load_artifact(p)
    with pytest.raises(FileExistsError):
        A.save_artifact(exported, p)


def test_sampler_block_artifact_reproduces_live_sampler_in_fresh_process(tmp_path):
    """jax.export of the sampler's whole block program (denoising loop + EOS + commit) for cpu and cuda; the CPU
    artifact, reloaded in a fresh process that has no dgemma model code path, generates the live sampler's tokens."""
    import math

    from dgemma.convert.artifact import export_fn, save_artifact
    from dgemma.inference.sampler import SamplerConfig, block_function, row_key_data, sample

    model = Transformer(tiny(), rngs=nnx.Rngs(2))
    cfg = SamplerConfig(max_steps=6, max_new_tokens=16, eos_ids=(1,), pad_id=0)
    B, P = 2, 5
    prompts = jax.random.randint(jax.random.key(3), (B, P), 3, model.cfg.vocab_size)
    valid = jnp.ones((B, P), bool)
    key = jax.random.key(11)
    live = sample(model, prompts, valid, cfg, key, "diffusion")
    fn, prefill, state = block_function(model, cfg)
    n_blocks = math.ceil(cfg.max_new_tokens / model.cfg.canvas_length)
    cache, last_hidden = prefill(state, prompts, valid, P + n_blocks * model.cfg.canvas_length)
    keys = row_key_data(key, B)
    finished = jnp.zeros((B,), bool)
    exported = export_fn(fn, state, cache, last_hidden, finished, keys, jnp.int32(0), jnp.asarray(False),
                         platforms=("cpu", "cuda"))
    assert set(exported.platforms) == {"cpu", "cuda"}
    save_artifact(exported, tmp_path / "block")
    leaves = jax.tree.leaves((state, cache, last_hidden, finished, keys))
    np.savez(tmp_path / "inputs.npz", *[np.asarray(x) for x in leaves])
    script = textwrap.dedent(f"""
        import json, numpy as np, jax, jax.numpy as jnp
        from dgemma.convert.artifact import load_artifact
        art = load_artifact({str(tmp_path / "block")!r})
        data = np.load({str(tmp_path / "inputs.npz")!r})
        leaves = [jnp.asarray(data[f"arr_{{i}}"]) for i in range(len(data.files))]
        n_cache = len(leaves) - 3
        out = []
        for b in range({n_blocks}):
            res = jax.tree.leaves(art.call_flat(leaves + [jnp.int32(b), jnp.asarray(b == {n_blocks - 1})]))
            tokens, fin = res[0], res[1]
            out.append(np.asarray(tokens).tolist())
            n_state = len(leaves) - len(res)  # inputs: state + cache + last_hidden + finished + keys
            leaves = leaves[:n_state] + list(res[2:]) + [fin, leaves[-1]]
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    blocks = json.loads(proc.stdout.strip().splitlines()[-1])
    got = np.concatenate([np.asarray(b) for b in blocks], axis=1)
    np.testing.assert_array_equal(got, live.tokens)


def test_step_artifact_loop_decodes_a_block_as_the_sampler_does():
    """The exported step, looped from the sampler's initial block state (noise canvas from the block key, zero
    self-conditioning) while the stop rule has not fired for every row, produces the sampler's draft after every
    step and each row's decoder passes: the artifact runs the sampler's per-step rule, not a copy of it."""
    from dgemma.inference.sampler import row_key_data, sample
    from dgemma.model.cache import KVCache

    model = Transformer(tiny(), rngs=nnx.Rngs(2))
    state = nnx.state(model, nnx.Param)  # widen weights: sharper logits, mean entropies ~2.5-3.6
    nnx.update(model, jax.tree.map(lambda x: x * 8.0 if x.ndim > 1 else x, state))
    L, V = model.cfg.canvas_length, model.cfg.vocab_size
    # stop on mean entropy < 3.1 alone: here the rows stop after 2, 4 and 1 steps (each >= 0.05 nats from 3.1)
    cfg = SamplerConfig(max_steps=6, max_new_tokens=L, eos_ids=(1,), pad_id=0, confidence_threshold=3.1,
                        stability_threshold=0, record_drafts=True)
    B, P = 3, 5
    prompts = jax.random.randint(jax.random.key(3), (B, P), 3, V)
    valid = jnp.ones((B, P), bool)
    key = jax.random.key(11)
    live = sample(model, prompts, valid, cfg, key, "diffusion")
    fn, params = A.denoise_step(model, cfg)
    _, cache = model.encode(prompts, KVCache.init(model.cfg, B, P + L), valid)
    block_keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(row_key_data(key, B)),
                                             jnp.zeros((B,), jnp.uint32))  # block 0
    canvas = jax.vmap(lambda k: jax.random.randint(jax.random.fold_in(k, 0), (L,), 0, V, jnp.int32))(block_keys)
    state = {"canvas": canvas,
             "soft_embeds": jnp.zeros((B, L, model.cfg.hidden_size), jnp.dtype(model.cfg.execution.dtype)),
             "draft": canvas, "done": jnp.zeros((B,), bool),
             "history": jnp.full((max(cfg.stability_threshold, 1), B, L), -1, jnp.int32)}
    args = lambda i: (params, state["canvas"], A.cache_to_dict(cache), state["soft_embeds"],  # noqa: E731
                      state["draft"], state["done"], state["history"], jnp.int32(i), jax.random.key_data(block_keys))
    exported = A.export_fn(fn, *args(0), platforms=("cpu",))
    drafts, passes = [], np.zeros(B, np.int64)
    for i in range(cfg.max_steps):
        if bool(np.all(state["done"])):
            break
        passes += ~np.asarray(state["done"])
        out = exported.call(*args(i))
        state = {k: out[k] for k in state}
        drafts.append(np.asarray(out["draft"]))
    assert len(drafts) == int(live.steps_run[0])
    assert len(set(passes.tolist())) > 1  # the premise: rows stopped at different steps (freezing is exercised)
    np.testing.assert_array_equal(np.stack(drafts), live.drafts[0, :len(drafts)])
    np.testing.assert_array_equal(passes, live.steps_per_block[:, 0])
