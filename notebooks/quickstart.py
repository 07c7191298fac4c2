# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # dgemma quickstart: one set of weights, three modes
#
# A tiny Gemma-4-architecture model (MoE, sliding + full attention, K=V full layers) used as
# (1) an AR LM, (2) the DiffusionGemma causal encoder that fills a KV cache, and (3) the bidirectional canvas decoder
# with self-conditioning. Runs on a laptop CPU in seconds. Open with `jupytext --to notebook` or run as a script.

# %%
import jax
import jax.numpy as jnp
from flax import nnx

from dgemma.inference.ar import generate
from dgemma.model.cache import KVCache
from dgemma.model.config import preset
from dgemma.model.transformer import Transformer

SMALL = True  # the tiny preset; set False only on an accelerator with a real checkpoint
cfg = preset("tiny")
model = Transformer(cfg, rngs=nnx.Rngs(0))
print(cfg.layer_types, f"{cfg.num_experts} experts, top-{cfg.top_k_experts}, canvas {cfg.canvas_length}")

# %% [markdown]
# ## AR mode and the encoder share the cache path exactly

# %%
prompt = jax.random.randint(jax.random.key(0), (1, 10), 3, cfg.vocab_size)
full = model(prompt)  # causal LM logits
cache = KVCache.init(cfg, 1, 32)
hidden, cache = model.encode(prompt, cache)  # prefill writes the KV cache
print("encoder == AR:", float(jnp.abs(model.logits(hidden) - full).max()))
print("AR greedy:", generate(model, prompt, max_new_tokens=8).tolist())

# %% [markdown]
# ## Decoder mode: denoise a canvas of uniform noise, feeding the previous step back through self-conditioning

# %%
canvas = jax.random.randint(jax.random.key(1), (1, cfg.canvas_length), 0, cfg.vocab_size)
logits = model.logits(model.decode(canvas, cache))  # step 1: self-conditioning input is exactly zero
tempered = logits / 0.8
logits2 = model.logits(model.decode(jnp.argmax(logits, -1), cache, sc_logits=tempered))  # step 2
print("cache length unchanged by the decoder:", int(cache.length))
print("step-2 argmax:", jnp.argmax(logits2, -1).tolist())
