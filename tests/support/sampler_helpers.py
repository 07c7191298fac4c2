"""Tiny models and recorders shared by the sampler tests of several layers (tests/inference, tests/train,
tests/convert): a random dgemma model whose denoiser converges, batches of left-padded prompts, and the transformers
DiffusionGemma twin with the recorders of its sampler's decisions."""

import numpy as np

import jax.numpy as jnp
from flax import nnx

from dgemma.model.config import tiny
from dgemma.model.transformer import abstract_model

GAMMA = 1.0  # the parity tests' entropy bound


def converging_model(seed=3, post=0.1, sc=0.1):
    """Random tiny model whose denoiser converges: post-sublayer norms x0.1 (the residual dominates), SC x0.1.

    (A plain random model never stabilizes its argmax: every block would run to max_steps.)
    """
    m = abstract_model(tiny())  # shapes only; every value is drawn below with numpy (fast, no per-op compiles)
    flat = nnx.to_flat_state(nnx.state(m, nnx.Param))
    rng = np.random.default_rng(seed)
    for path, var in flat:
        name, shape = "/".join(map(str, path)), var.shape
        if name.endswith("scale") or "layer_scalar" in name:
            v = (1.0 + 0.5 * rng.standard_normal(shape)) * (post if "post_" in name else 1.0)
        else:
            v = 0.2 * rng.standard_normal(shape) * (sc if "self_conditioning" in name and "down" in name else 1.0)
        var.set_value(jnp.asarray(v, var.dtype))
    nnx.update(m, nnx.from_flat_state(flat))
    return m


def batch_prompts(B=8, P=7, seed=1):
    rng = np.random.default_rng(seed)
    prompts = rng.integers(3, 120, (B, P)).astype(np.int32)
    lengths = rng.integers(3, P + 1, B)
    lengths[0] = P
    valid = np.arange(P)[None] >= (P - lengths)[:, None]
    prompts[~valid] = 0
    return prompts, valid, lengths


def converging_dg(seed=21):
    from support import hf_reference as R
    import torch

    hf = R.diffusion_gemma("a", seed=seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "language_model" in name and ".post_" in name and "norm" in name:
                p.mul_(0.2)
        hf.model.decoder.self_conditioning.down_proj.weight.mul_(0.3)
    return hf


def record_decisions(mp) -> list[dict]:
    """Per denoising step of `generate`: which rows were still denoising, the tempered logits z the decisions are
    made on, and where the proposal differs from the canvas (the only places the accept decision matters)."""
    from transformers.models.diffusion_gemma import generation_diffusion_gemma as G

    steps = []
    step, accept = G.DiffusionGemmaGenerationMixin._denoising_step, G.EntropyBoundSampler.accept_canvas

    def recording_step(self, *a, finished_denoising, **k):
        steps.append({"active": ~finished_denoising.numpy().copy()})
        return step(self, *a, finished_denoising=finished_denoising, **k)

    def recording_accept(self, current, proposal, logits, *a, **k):
        steps[-1].update(z=logits.detach().numpy().astype(np.float64), changes=(proposal != current).numpy())
        return accept(self, current, proposal, logits, *a, **k)

    mp.setattr(G.DiffusionGemmaGenerationMixin, "_denoising_step", recording_step)
    mp.setattr(G.EntropyBoundSampler, "accept_canvas", recording_accept)
    return steps


def margins(steps, conf) -> dict[str, float]:
    """How far the reference's discrete decisions (rows still denoising) are from flipping: the argmax's top-2 gap,
    the entropy-bound accept's |sum of lower entropies - gamma| where the proposal changes the canvas, and the stop
    rule's |mean entropy - c|. transformers and dgemma compute z ~1e-4 apart (entropies ~1e-5): a decision closer
    than ~100x that to its threshold makes the comparison depend on the machine, not on the code."""
    m = {"argmax": np.inf, "accept": np.inf, "stop": np.inf}
    for st in steps:
        z, act = st["z"][st["active"]], st["active"]
        if not act.any():
            continue
        top2 = np.sort(z, -1)[..., -2:]
        m["argmax"] = min(m["argmax"], float((top2[..., 1] - top2[..., 0]).min()))
        logp = z - np.logaddexp.reduce(z, -1, keepdims=True)
        h = -(np.exp(logp) * logp).sum(-1)  # [rows, L]
        order = np.argsort(h, -1, kind="stable")
        hs = np.take_along_axis(h, order, -1)
        below = np.cumsum(hs, -1) - hs
        changes = np.take_along_axis(st["changes"][act], order, -1)
        if changes.any():
            m["accept"] = min(m["accept"], float(np.abs(below - GAMMA)[changes].min()))
        m["stop"] = min(m["stop"], float(np.abs(h.mean(-1) - conf).min()))
    return m


MIN_MARGINS = {"argmax": 1e-2, "accept": 1e-3, "stop": 1e-4}  # ~100x the torch-vs-XLA difference of each quantity
