"""dgemma.model: the Gemma 4 MoE transformer with its DiffusionGemma modes (encoder, decoder, self-conditioning).

Modules:
  config                ModelConfig and presets (`gemma4_26b_a4b`, the family, `tiny`, `tiny_toy`), execution settings
  transformer           blocks, the stack, the causal encoder / bidirectional decoder modes, self-conditioning
  layers                RMSNorm, embedder, gated MLP, RoPE
  attention             GQA, q/k RMSNorm, weightless v norm, K=V on full layers, mask-driven visibility
  attention_chunked     flash-style attention in pure JAX over a structured mask, never a [T, S] array
  attention_mask        attention masks as structure (per-query key intervals)
  masks                 masks for the inference modes, dense or as structure
  cache                 KV cache: full-length slots for full layers, a ring for sliding layers
  moe                   the router and dropless sorted `ragged_dot` experts
  moe_ep                expert parallelism: a `shard_map` dispatch over one mesh axis, dropless
  kernels               accelerator kernels from maintained libraries (Pallas TPU ops, Tokamax), chosen by config
  scan                  scanned layers and rematerialisation policies
  shared_scan_grads     one parameter-gradient stack for two scans over the same layers (split-stream passes)
  activation_sharding   keep activations sharded on the batch under FSDP
  per_layer_embeddings  per-layer embeddings (PLE) of E2B / E4B, as transformers' `Gemma4TextModel`
  kv_sharing            KV sharing of E2B / E4B, as transformers' `kv_sharing_modes`
  lora                  low-rank adapters on the matmul weights: attach, compute, merge
  lora_experts          the adapters' call-site hooks: dense matmuls and the experts' grouped matmuls
"""
