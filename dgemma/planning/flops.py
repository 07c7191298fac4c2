"""FLOPs of the planner (`dgemma.planning.planner`): per token, per forward and per optimizer step, as implemented.

FLOPs per optimizer step (matmul + attention FLOPs as the model computes them: dense attention computes every score,
`model.execution.attention_impl=chunked` only the tiles the mask can reach): training forward+backward = 3 x forward,
plus the recomputed forward under remat (the whole block for full/offload, attention only for save_dots), plus one
gradient-free forward for self-conditioning (stage 1 with p_self_cond > 0 runs that pass on every row);
`model_flops` is the usual 6 x active params x tokens over the tokens a forward processes (P + 2R in stage 1).
"""

from __future__ import annotations

from typing import Any

from dgemma.model.config import SLIDING, ModelConfig
from dgemma.train.objectives import get_objective

__all__ = ["active_params", "attended_keys", "forward_flops", "layer_matmul_params", "model_matmul_params",
           "skips_masked_tiles", "step_flops"]


def skips_masked_tiles(m: ModelConfig) -> bool:
    """Flash-style attention (the pure-JAX "chunked" path or the Splash kernel): O(T) memory, masked tiles skipped."""
    return m.execution.attention_impl in ("chunked", "splash")


def layer_matmul_params(m: ModelConfig, layer: int, dense_moe: bool = False) -> int:
    """Weights one token multiplies with in a layer (active experts only; all E per slot for the CPU fallback): q/o,
    k and v where the layer computes them (none on KV-shared layers, no v on K = V full layers), the dense MLP of the
    layer's width, router and experts with `enable_moe_block`, the per-layer input gate and projection with PLE."""
    H, N, D, KV = m.hidden_size, m.num_attention_heads, m.layer_head_dim(layer), m.layer_kv_heads(layer)
    own_kv = m.kv_producer(layer) is None
    kv = (int(own_kv) + int(own_kv and m.layer_has_v_proj(layer))) * H * KV * D
    moe = (H * m.num_experts + (m.num_experts if dense_moe else 1) * m.top_k_experts * 3 * H
           * m.moe_intermediate_size) if m.enable_moe_block else 0
    return 2 * H * N * D + kv + 3 * H * m.layer_mlp_width(layer) + moe + 2 * H * m.hidden_size_per_layer_input


def model_matmul_params(m: ModelConfig) -> int:
    """Weights one token multiplies with outside the layers (the head apart): the per-layer embeddings' context
    projection [H, L * P] (the PLE table is a lookup)."""
    return m.hidden_size * m.num_hidden_layers * m.hidden_size_per_layer_input


def active_params(m: ModelConfig) -> int:
    """Parameters used per token (embedding counted once as the tied head; lookup tables not counted)."""
    return (sum(layer_matmul_params(m, i) for i in range(m.num_hidden_layers)) + model_matmul_params(m)
            + m.vocab_size * m.hidden_size)


def attended_keys(m: ModelConfig, layer: int, tokens: int, prompt_len: int | None = None) -> float:
    """Keys a query's scores are computed for, on average, as implemented: every key for dense attention; for
    chunked attention the causal (sliding: windowed) triangle, rounded up to whole tiles. In the one-pass layout
    (`prompt_len` given, tokens = P + 2R) noisy queries see the clean prefix up to their block and their own block,
    which costs about what a causal clean stream costs; the estimate uses the causal count over P + R twice."""
    if not skips_masked_tiles(m):
        return float(tokens)
    span = tokens if prompt_len is None else (tokens + prompt_len) // 2  # P + R per stream
    tile = max(m.execution.attention_kv_chunk, 1)
    if m.layer_types[layer] == SLIDING:
        return float(min(span, m.sliding_window + tile))
    return float(min(span, span / 2 + tile))


def forward_flops(m: ModelConfig, tokens: int, logit_positions: int, dense_moe: bool = False,
                  prompt_len: int | None = None, layout_tokens: int | None = None) -> float:
    """FLOPs of one forward over `tokens` tokens with `logit_positions` logits (attention: `attended_keys` of a layout
    of `layout_tokens`, default `tokens`: e.g. the noisy stream's R queries over the one-pass layout's keys)."""
    layout = tokens if layout_tokens is None else layout_tokens
    trunk = sum(2 * layer_matmul_params(m, i, dense_moe)
                + 4 * attended_keys(m, i, layout, prompt_len) * m.num_attention_heads * m.layer_head_dim(i)
                for i in range(m.num_hidden_layers)) + 2 * model_matmul_params(m)
    return tokens * trunk + 2 * logit_positions * m.hidden_size * m.vocab_size


def _attention_flops(m: ModelConfig, tokens: int, prompt_len: int | None) -> float:
    return tokens * sum(4 * attended_keys(m, i, tokens, prompt_len) * m.num_attention_heads * m.layer_head_dim(i)
                        for i in range(m.num_hidden_layers))


def step_flops(spec: Any) -> tuple[float, float]:
    """(implementation FLOPs, 6 * active params * tokens) per optimizer step of a `planner.PlanSpec`, global."""
    m, T, R = spec.model, spec.tokens_per_example, spec.response_len
    clean = spec.prompt_len + R
    dense = spec.moe_lowering in ("dense", "dense_compute")  # TPU ragged_dot: dense FLOPs, ragged memory
    objective = get_objective(spec.objective)
    one_pass = objective.layout == "one_pass"  # logits at the clean stream + the noisy blocks, not every position
    p = spec.prompt_len if one_pass else None
    logits = clean + R if one_pass else T
    fwd = forward_flops(m, T, logits, dense, p)
    per_example = 3 * fwd  # forward + backward (2x)
    if spec.remat in ("block", "full", "offload"):
        # the blocks' forward again (not the head, nor the per-layer inputs made before the stack)
        per_example += fwd - 2 * logits * m.hidden_size * m.vocab_size - 2 * T * model_matmul_params(m)
    elif spec.remat == "save_dots":
        per_example += _attention_flops(m, T, p)  # only attention (no weight matmuls) is recomputed
    if objective.self_conditioning_pass and spec.self_conditioning_pass:
        sc_tokens = R if spec.self_cond_pass == "noisy_stream" else T  # the clean stream is not recomputed
        per_example += forward_flops(m, sc_tokens, R, dense, p, layout_tokens=T)
        if m.self_conditioning:
            per_example += 2 * R * (3 * m.hidden_size * m.intermediate_size + m.hidden_size * m.vocab_size)
    model = 6 * active_params(m) * T
    return per_example * spec.global_batch, model * spec.global_batch
