"""Nonsense config values are refused at load, naming the field (no value is silently clamped or ignored)."""

from pathlib import Path

import pytest

from dgemma.config import ConfigError, load_config
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

TINY = str(Path(__file__).resolve().parents[2] / "configs/stage1/tiny.yaml")


@pytest.mark.parametrize("override, message", [
    ("optim.lr=.nan", "optim.lr: nan is not a finite number"),
    ("optim.lr=.inf", "optim.lr: inf is not a finite number"),
    ("optim.clip_norm=.nan", "optim.clip_norm: nan"),
    ("optim.weight_decay=.nan", "optim.weight_decay: nan"),
    ("sampler.entropy_bound=.nan", "sampler.entropy_bound: nan"),
    ("model.rms_norm_eps=-1e-6", "model.rms_norm_eps: -1e-06 must be a finite number > 0"),
    ("model.partial_rotary_factor_full=1.5", "model.partial_rotary_factor_full: 1.5 must be in (0, 1]"),
    ("model.eos_token_id=[40]", "model.eos_token_id: [40] must be non-empty ids in [0, vocab_size=32)"),
    ("model.pad_token_id=-1", "model.pad_token_id: [-1]"),
    ("model.num_hidden_layers=0", "model.num_hidden_layers: 0 must be >= 1"),
    ("model.hidden_size=0", "model.hidden_size: 0 must be >= 1"),
])
def test_nonsense_values_are_refused_at_load(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [override], env={})
    assert message in str(info.value)


def test_sane_values_still_load():
    cfg = load_config(TINY, ["optim.lr=1e-3", "model.rms_norm_eps=1e-5", "model.partial_rotary_factor_full=1.0"],
                      env={})
    assert cfg.optim.lr == 1e-3 and cfg.model_config.partial_rotary_factor_full == 1.0


@pytest.mark.parametrize("override", ["data.tokenizer.eos_id=5", "data.tokenizer.pad_id=3",
                                      "data.tokenizer.extra_stop_ids=[4]"])
def test_toy_tokenizer_id_overrides_are_refused(override):
    with pytest.raises(ConfigError, match=override.split("=")[0].split(".")[-1] + ".*kind='hf' only"):
        load_config(TINY, [override], env={})


def test_freeze_regex_matching_nothing_is_refused():
    import numpy as np

    from dgemma.train.optim import frozen_flags

    params = {"embedder": {"embedding": np.zeros((4, 2))}, "layers": {"0": {"router": {"kernel": np.zeros((2, 2))}}}}
    assert frozen_flags(params, ("router",)) == (False, True)
    with pytest.raises(ValueError, match=r"optim.freeze: \['routr'\] match no parameter path"):
        frozen_flags(params, ("router", "routr"))
    with pytest.raises(ValueError, match="optim.freeze: invalid regex"):
        frozen_flags(params, ("(",))


# MARK: model.canvas_length: what the code can and cannot do with an odd value such as 7. ----------
REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / "configs/stage1/tiny.yaml"
BIG = REPO / "configs/stage1/gemma4_26b_a4b.yaml"


def test_an_odd_canvas_length_loads_with_dense_attention():
    cfg = load_config(TINY_CONFIG, ["model.canvas_length=7"], env={})
    assert cfg.model_config.canvas_length == 7 and cfg.data.layout.canvas_length == 7


@pytest.mark.parametrize("objective, stream, T", [("stage1", "one-pass [clean ; noisy] stream", 1080),
                                                  ("ar", "training sequence", 1052)])
def test_chunked_attention_refuses_a_canvas_that_does_not_tile(objective, stream, T):
    with pytest.raises(ConfigError) as info:
        load_config(BIG, ["model.canvas_length=7", f"trainer.objective={objective}"], env={})
    msg = str(info.value)
    assert len(msg.splitlines()) == 1, msg
    assert f"model.canvas_length=7: the {stream}" in msg and f"= {T} tokens" in msg
    assert "model.execution.attention_q_chunk=512" in msg and "model.execution.attention_impl=chunked" in msg
    valid = "64, 128, 192, 256" if objective == "stage1" else "128, 256, 384"
    assert f"canvas_length may be {valid}" in msg, msg
    load_config(BIG, [f"model.canvas_length={valid.split(', ')[0]}", f"trainer.objective={objective}"], env={})


def test_a_sequence_within_one_chunk_needs_no_tiling():
    # tiny: 16 + 2 x 2 x 7 = 44 tokens, within one 64-token chunk
    load_config(TINY_CONFIG, ["model.canvas_length=7", "model.execution.attention_impl=chunked",
                       "model.execution.attention_q_chunk=64", "model.execution.attention_kv_chunk=64"], env={})
    with pytest.raises(ConfigError, match="44 tokens is longer than model.execution.attention_q_chunk=16"):
        load_config(TINY_CONFIG, ["model.canvas_length=7", "model.execution.attention_impl=chunked",
                           "model.execution.attention_q_chunk=16", "model.execution.attention_kv_chunk=16"], env={})


def test_one_pass_training_equals_block_by_block_decoding_at_canvas_length_7():
    """The stage-1 invariant (one pass over [clean ; noisy] = the sampler's cached block decode) at an odd L, on a
    layout from the data layout (left-padded prompt, a row whose second canvas is unused)."""
    from dgemma.data.layout import to_layout
    from dgemma.data.config import LayoutConfig
    from dgemma.diffusion import masks as bd_masks
    from dgemma.diffusion.stage1 import one_pass_hidden, one_pass_masks
    from dgemma.model.cache import KVCache
    from dgemma.model.config import tiny
    from dgemma.model.transformer import Transformer

    P, L, N = 5, 7, 2
    cc = LayoutConfig(prompt_len=P, canvas_length=L, n_blocks=N)
    rows = [to_layout([2, 7, 8, 9, 10], list(range(3, 13)), cc), to_layout([2, 7, 8], [4, 5, 6], cc)]
    batch = {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in ("tokens", "valid", "block_id", "positions")}
    assert batch["tokens"].shape == (2, P + N * L) and not bool(rows[1]["block_used"][1])
    model = Transformer(tiny(tie_layer_scalar=False, canvas_length=L), rngs=nnx.Rngs(0))
    x_t = jax.random.randint(jax.random.key(1), (2, N * L), 0, model.cfg.vocab_size)

    @nnx.jit
    def one_pass(model, batch, x_t):
        streams = bd_masks.concat_streams(batch["tokens"], x_t, batch["positions"], batch["valid"], batch["block_id"])
        return model.logits(one_pass_hidden(model, streams, one_pass_masks(model.cfg, streams), P + N * L))

    @nnx.jit
    def block(model, tokens, valid, canvas):
        _, cache = model.encode(tokens, KVCache.init(model.cfg, tokens.shape[0], P + N * L), valid)
        return model.logits(model.decode(canvas, cache))

    logits = np.asarray(one_pass(model, batch, x_t))
    T = P + N * L
    for b in range(N):
        end = P + b * L
        ref = np.asarray(block(model, batch["tokens"][:, :end], batch["valid"][:, :end], x_t[:, b * L:(b + 1) * L]))
        used = [r for r in range(2) if rows[r]["block_used"][b]]
        np.testing.assert_allclose(logits[used, T + b * L:T + (b + 1) * L], ref[used], atol=5e-5, rtol=0,
                                   err_msg=f"block {b}")
