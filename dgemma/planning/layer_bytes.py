"""Bytes per token that one layer keeps for the backward pass, for the planner (`dgemma.planning.planner`): every
member of the Gemma 4 family, layer by layer, as `dgemma.model.transformer.Block` builds it.

What a layer has depends on the member (`dgemma.model.config.ModelConfig`):
  - K/V projections, k_norm and v_norm only where the layer computes its own K/V (`kv_producer(i) is None`; a
    KV-shared layer reads its producer's keys and values, already counted at the producer); a v projection only
    where `layer_has_v_proj(i)` (sliding layers, and full layers without `attention_k_eq_v`);
  - a dense MLP of `layer_mlp_width(i)` (double-wide on the KV-shared layers of E2B);
  - experts, router and the MoE's own norms only with `enable_moe_block` (26B-A4B);
  - the per-layer input gate (gate [H, P], projection [P, H], a post-norm) with per-layer embeddings
    (`hidden_size_per_layer_input` = P > 0, E2B / E4B); the model-level per-layer inputs u [T, L, P]
    (`per_layer_input_bytes`) are made once before the stack and live until the backward.
"""

from __future__ import annotations

from dgemma.model.config import ModelConfig
from dgemma.model.moe_ep import ep_rows_per_token
from dgemma.planning.flops import skips_masked_tiles

__all__ = ["HEAD_PHASE_FREED", "MOE_BACKWARD_SLOT_ROWS", "flash_memory", "head_backward_bytes", "layer_token_bytes",
           "per_layer_input_bytes", "saved_dot_bytes"]

# Slot rows of width H (activation dtype) alive at once in the backward of one layer's sort-based MoE dispatch:
# counted in XLA's buffer live ranges of the 26B v5p-64 stage-1 compile at 2 examples per chip (6.6 GB of
# [49,152 slots, H] buffers at the peak = 23.8 rows; docs/planner_compile.md), checked against the compile at 1 per chip.
MOE_BACKWARD_SLOT_ROWS = 24


def flash_memory(m: ModelConfig) -> bool:
    """No [T, S] scores kept: the skipping paths (chunked, Splash) and Tokamax's kernels (which take the mask as a
    boolean [T, S] input and compute every tile: dense FLOPs, `flops.attended_keys`)."""
    return skips_masked_tiles(m) or m.execution.attention_impl == "tokamax"


def _ep_moe_token_bytes(m: ModelConfig, a: int, ep: int, dense_moe: bool) -> float:
    """Bytes per own token of the expert-parallel dispatch (`dgemma.model.moe_ep`): the group's gathered tokens,
    routing and fp32 per-token sums (ep x), and the dropless row buffer of ep * min(k, E/ep) rows per own token
    (input rows, gate/up/gelu/product, output rows, fp32 weighted rows, sort indices), whatever the routing."""
    H, I, E, k = m.hidden_size, m.moe_intermediate_size, m.num_experts, m.top_k_experts
    rows = ep_rows_per_token(k, E, ep)
    out = E * (a + 4) + ep * (H * a + 8 * k + 4 * H) + rows * (2 * H * a + 4 * I * a + 4 * H + 8)
    if dense_moe:  # CPU ragged_dot fallback: one dense slab per local expert
        out += (E // ep) * rows * (2 * H + 2 * I) * a
    return out


def layer_token_bytes(m: ModelConfig, layer: int, seq: int, a: int, dense_moe: bool = False,
                      ep: int | None = None) -> dict[str, float]:
    """Bytes per token that one layer keeps for the backward pass (no remat); `a` = activation dtype bytes; `ep`:
    the expert-parallel group size when the MoE dispatches with `dgemma.model.moe_ep` (None: the single-sort MoE)."""
    H, N, D, KV = m.hidden_size, m.num_attention_heads, m.layer_head_dim(layer), m.layer_kv_heads(layer)
    own_kv = m.kv_producer(layer) is None
    P = m.hidden_size_per_layer_input
    # H-wide RMSNorms keeping fp32 inputs + outputs: pre/post attention, pre-MLP, post-FFW; with MoE also the
    # post-MLP, pre/post-MoE and router norms; with PLE the per-layer gate's post-norm. Plus the residual sums.
    n_norms = (8 if m.enable_moe_block else 4) + (1 if P else 0)
    norms = n_norms * (4 + a) * H + 3 * a * H
    qkv = (N * D * (4 + 4 * a) + (KV * D * (4 + 3 * a) if own_kv else 0)
           + (KV * D * (4 + 2 * a) if own_kv and m.layer_has_v_proj(layer) else 0))
    if flash_memory(m):
        scores = N * 4  # flash attention keeps the output (in qkv) and one fp32 log-sum-exp per query and head
    else:
        scores = N * seq * (4 + 2 * a)  # masked scores, fp32 softmax output, its cast (PV grad); over all keys
    out = {"norms_residual": norms, "attention_proj": qkv, "attention_scores": scores,
           "dense_mlp": 4 * m.layer_mlp_width(layer) * a, "moe": 0.0}
    if m.enable_moe_block:
        moe = m.top_k_experts * (H * (2 * a + 4) + 4 * m.moe_intermediate_size * a) + m.num_experts * (a + 4)
        if dense_moe:  # CPU ragged_dot: inputs expanded to [E, T*k, .] for the forward and both transposes
            moe += m.num_experts * m.top_k_experts * (2 * H + 2 * m.moe_intermediate_size) * a
        out["moe"] = moe if ep is None else _ep_moe_token_bytes(m, a, ep, dense_moe)
    if P:  # the per-layer input gate: gate output, its gelu, the product with u_i, the projection
        out["per_layer_gate"] = (3 * P + H) * a
    return out


def saved_dot_bytes(m: ModelConfig, layer: int, a: int) -> float:
    """Bytes per token of a layer's weight-matmul outputs (what remat=save_dots keeps): q (and k / v where the layer
    computes them), o_proj, dense MLP gate/up/down, router logits, the per-layer gate and projection (expert matmuls
    are ragged_dot, not dots: recomputed)."""
    H, N, D, KV = m.hidden_size, m.num_attention_heads, m.layer_head_dim(layer), m.layer_kv_heads(layer)
    own_kv = m.kv_producer(layer) is None
    kv = (int(own_kv) + int(own_kv and m.layer_has_v_proj(layer))) * KV * D
    router = m.num_experts if m.enable_moe_block else 0
    ple = m.hidden_size_per_layer_input + H if m.hidden_size_per_layer_input else 0
    return (N * D + kv + H + 2 * m.layer_mlp_width(layer) + H + router + ple) * a


def per_layer_input_bytes(m: ModelConfig, a: int) -> int:
    """Bytes per token of the model-level per-layer inputs (PLE) kept for the backward: the context projection's
    output, its norm's fp32 input and output, and u itself, each [L * P] (0 without PLE). The table lookup keeps
    only the token ids."""
    return m.num_hidden_layers * m.hidden_size_per_layer_input * (4 + 3 * a)


# Activation terms not alive while the loss head is differentiated (it runs before any layer's backward): the
# recomputed layer and its transients, and the chunk logits that `head_backward_bytes` counts itself.
HEAD_PHASE_FREED = ("recomputed_block", "attention_tile", "moe_dispatch_backward", "sharded_gathered_experts",
                    "ep_gathered_experts", "logits")


def head_backward_bytes(m: ModelConfig, a: int, examples: float, chunk: int) -> float:
    """Bytes of the chunked loss head's backward (`dgemma.diffusion.losses.token_nll_from_hidden`) when the tied
    [V, H] table is FSDP-sharded and trained: inside the chunk loop the TPU partitioner all-gathers the table in the
    activation dtype, forms each chunk's table gradient whole in fp32 and all-reduces it in the activation dtype
    (no reduce-scatter), beside one [examples, chunk, V] fp32 logits chunk. Read in the live ranges of the deviceless
    v5p-64 compiles of E2B stage 1 (docs/planner_compile.md, "E2B stage 1 on v5p-64"): f32 [V, H] + 2 x bf16 [V, H]
    + f32 [chunk, V]. The second bf16 table is the diffusion head's gathered table, which XLA kept across the AR
    head's chunk loop there; in the E4B and 31B compiles it frees it first (one bf16 table at the peak, "E4B and 31B
    stage 1 on v5p-64"), a scheduling choice the planner cannot see, so it keeps the larger E2B count."""
    V, H = m.vocab_size, m.hidden_size
    return V * H * (4 + 2 * a) + examples * chunk * V * 4
