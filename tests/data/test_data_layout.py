"""`to_layout`: exact arrays for hand-written examples (the module docstring's worked example and variants)."""

import numpy as np
import pytest

from dgemma.data.layout import (
    EXAMPLE_KEYS,
    LayoutOverflowError,
    to_layout,
    empty_example,
    example_spec,
    response_before_eos,
)
from dgemma.data.config import LayoutConfig

PAD, EOS, BOS = 0, 1, 2
CFG = LayoutConfig(prompt_len=4, canvas_length=4, n_blocks=3)


def _arr(*xs):
    return np.array(xs)


def _check_spec(ex, cfg):
    spec = example_spec(cfg)
    assert tuple(ex) == EXAMPLE_KEYS == tuple(spec)
    for k, (shape, dtype) in spec.items():
        assert ex[k].shape == shape and ex[k].dtype == dtype, k


def test_docstring_example_tail_eos():
    ex = to_layout([BOS, 7, 8], [5, 6, 9, 4, 3], CFG)
    _check_spec(ex, CFG)
    np.testing.assert_array_equal(ex["tokens"], _arr(PAD, BOS, 7, 8, 5, 6, 9, 4, 3, EOS, EOS, EOS, PAD, PAD, PAD, PAD))
    np.testing.assert_array_equal(ex["positions"], np.arange(16))
    np.testing.assert_array_equal(ex["valid"], _arr(0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0).astype(bool))
    np.testing.assert_array_equal(ex["prompt_mask"], _arr(0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0).astype(bool))
    np.testing.assert_array_equal(ex["block_id"], _arr(-2, -1, -1, -1, 0, 0, 0, 0, 1, 1, 1, 1, -2, -2, -2, -2))
    np.testing.assert_array_equal(ex["block_used"], [True, True, False])
    np.testing.assert_array_equal(ex["diffusion_weight"], _arr(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0))
    np.testing.assert_array_equal(
        ex["ar_targets"], _arr(BOS, 7, 8, 5, 6, 9, 4, 3, EOS, EOS, EOS, PAD, PAD, PAD, PAD, PAD)
    )
    # i predicts i+1: the last prompt token (i=3) predicts the first response token; the EOS (i=9) is the last
    # target; tail and padding get nothing.
    np.testing.assert_array_equal(ex["ar_weight"], _arr(0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0))
    assert ex["example_mask"] and ex["prompt_length"] == 3 and ex["response_length"] == 6
    np.testing.assert_array_equal(response_before_eos(ex, CFG), [5, 6, 9, 4, 3])


def test_tail_fill_pad_is_supervised():
    cfg = LayoutConfig(prompt_len=4, canvas_length=4, n_blocks=3, tail_fill="pad")
    ex = to_layout([BOS, 7, 8], [5, 6, 9, 4, 3], cfg)
    np.testing.assert_array_equal(ex["tokens"], _arr(PAD, BOS, 7, 8, 5, 6, 9, 4, 3, EOS, PAD, PAD, PAD, PAD, PAD, PAD))
    # the PAD tail is still a valid, supervised part of canvas 1
    np.testing.assert_array_equal(ex["valid"][8:12], [True] * 4)
    np.testing.assert_array_equal(ex["diffusion_weight"], _arr(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0))
    np.testing.assert_array_equal(ex["block_id"][8:], _arr(1, 1, 1, 1, -2, -2, -2, -2))


def test_eos_exactly_fills_a_block_and_eos_alone_opens_a_block():
    # 3 tokens + EOS = one full canvas: no tail, canvases 1 and 2 unused
    ex = to_layout([BOS], [5, 6, 7], CFG)
    np.testing.assert_array_equal(ex["tokens"], _arr(PAD, PAD, PAD, BOS, 5, 6, 7, EOS, *[PAD] * 8))
    np.testing.assert_array_equal(ex["block_used"], [True, False, False])
    np.testing.assert_array_equal(ex["ar_weight"], _arr(0, 0, 0, 1, 1, 1, 1, *[0] * 9))
    # 4 tokens fill canvas 0, so the EOS opens canvas 1 whose other 3 positions are tail
    ex = to_layout([BOS], [5, 6, 7, 8], CFG)
    np.testing.assert_array_equal(ex["tokens"][4:], _arr(5, 6, 7, 8, EOS, EOS, EOS, EOS, PAD, PAD, PAD, PAD))
    np.testing.assert_array_equal(ex["block_used"], [True, True, False])
    np.testing.assert_array_equal(ex["ar_weight"], _arr(0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0))


def test_empty_response_is_one_eos_block_and_full_layout_uses_all_canvases():
    ex = to_layout([BOS, 7, 8, 9], [], CFG)
    np.testing.assert_array_equal(ex["tokens"], _arr(BOS, 7, 8, 9, EOS, EOS, EOS, EOS, *[PAD] * 8))
    np.testing.assert_array_equal(ex["ar_weight"][:5], _arr(0, 0, 0, 1, 0))
    assert ex["prompt_mask"][:4].all() and ex["response_length"] == 1
    ex = to_layout([BOS], list(range(3, 14)), CFG)  # 11 tokens + EOS = exactly R = 12
    np.testing.assert_array_equal(ex["block_used"], [True, True, True])
    assert ex["valid"][3:].all() and ex["tokens"][-1] == EOS and ex["diffusion_weight"].all()


def test_response_already_ending_in_eos_is_not_double_terminated():
    a = to_layout([BOS], [5, 6], CFG)
    b = to_layout([BOS], [5, 6, EOS], CFG)
    for k in EXAMPLE_KEYS:
        np.testing.assert_array_equal(a[k], b[k])


def test_ar_flags():
    cfg = LayoutConfig(prompt_len=4, canvas_length=4, n_blocks=3, ar_on_prompt=True, ar_on_tail=True)
    ex = to_layout([BOS, 7, 8], [5, 6, 9, 4, 3], cfg)
    # prompt->prompt targets start at the first real token (index 1 predicts 2); the tail is now a target too,
    # the last tail token (index 11) has no valid successor.
    np.testing.assert_array_equal(ex["ar_weight"], _arr(0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0))


def test_prompt_truncation_policies():
    long_prompt = [BOS, 10, 11, 12, 13, 14]
    left = to_layout(long_prompt, [5], CFG)
    np.testing.assert_array_equal(left["tokens"][:4], [BOS, 12, 13, 14])  # BOS kept, oldest tokens dropped
    assert left["prompt_length"] == 4 and left["prompt_mask"][:4].all()
    no_bos = to_layout(long_prompt, [5], CFG, bos_id=None)
    np.testing.assert_array_equal(no_bos["tokens"][:4], [11, 12, 13, 14])
    right = to_layout(long_prompt, [5], LayoutConfig(prompt_len=4, canvas_length=4, n_blocks=3,
                                                     truncate_prompt="right"))
    np.testing.assert_array_equal(right["tokens"][:4], [BOS, 10, 11, 12])
    strict = LayoutConfig(prompt_len=4, canvas_length=4, n_blocks=3, truncate_prompt="error")
    with pytest.raises(LayoutOverflowError, match=r"example 17: prompt has 6 tokens > LayoutConfig.prompt_len=4"):
        to_layout(long_prompt, [5], strict, index=17)


def test_response_overflow_error_and_drop():
    with pytest.raises(LayoutOverflowError, match=r"example 3: response has 13 tokens incl. EOS > .* = 12"):
        to_layout([BOS], list(range(3, 15)), CFG, index=3)
    drop = LayoutConfig(prompt_len=4, canvas_length=4, n_blocks=3, response_overflow="drop")
    ex = to_layout([BOS], list(range(3, 15)), drop)
    _check_spec(ex, drop)
    assert not ex["example_mask"] and not ex["valid"].any() and not ex["block_used"].any()
    assert ex["diffusion_weight"].sum() == 0 and ex["ar_weight"].sum() == 0 and (ex["tokens"] == PAD).all()
    assert (ex["block_id"] == -2).all()
    np.testing.assert_array_equal(ex["positions"], np.arange(16))
    for k, v in empty_example(drop).items():
        np.testing.assert_array_equal(v, ex[k])


def test_custom_special_ids():
    ex = to_layout([9], [5], CFG, pad_id=13, eos_id=12, bos_id=None)
    np.testing.assert_array_equal(ex["tokens"][:8], [13, 13, 13, 9, 5, 12, 12, 12])
    assert (ex["tokens"][8:] == 13).all() and (ex["ar_targets"][-1] == 13)


def test_canvas_config_validation():
    with pytest.raises(ValueError, match="LayoutConfig.tail_fill"):
        LayoutConfig(tail_fill="zeros")
    with pytest.raises(ValueError, match="LayoutConfig.canvas_length"):
        LayoutConfig(canvas_length=0)
    with pytest.raises(ValueError, match="LayoutConfig.response_overflow"):
        LayoutConfig(response_overflow="truncate")
    with pytest.raises(ValueError, match="LayoutConfig.n_blocks"):
        LayoutConfig(n_blocks=1.5)
    cfg = LayoutConfig()  # canvas_length unset: a run config takes it from the model (its one owner)
    assert (cfg.canvas_length, cfg.tail_fill) == (None, "eos")
    with pytest.raises(ValueError, match="LayoutConfig.canvas_length: unset"):
        _ = cfg.seq_len
    assert LayoutConfig(canvas_length=256).seq_len == cfg.prompt_len + 4 * 256
