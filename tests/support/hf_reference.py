"""Tiny random transformers reference models (Gemma 4, DiffusionGemma), built offline.

Everything is randomized, including every norm weight, router scale, per-expert scale and the `layer_scalar`
*buffers* (default init sets them all to 1, which would hide (1 + w) bugs, swapped norms and missing scalars).
"""

from __future__ import annotations

import copy

import torch

SLIDING, FULL = "sliding_attention", "full_attention"

# Three parity configs: GQA on both layer kinds, window smaller than the test sequences, different depths/patterns.
TEXT_CONFIGS = {
    "a": dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              layer_types=[SLIDING, SLIDING, FULL], sliding_window=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, global_head_dim=32, num_global_key_value_heads=1, num_experts=4, top_k_experts=2,
              moe_intermediate_size=32),
    "b": dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
              layer_types=[SLIDING, FULL, SLIDING, FULL], sliding_window=6, num_attention_heads=4,
              num_key_value_heads=4, head_dim=8, global_head_dim=16, num_global_key_value_heads=2, num_experts=6,
              top_k_experts=3, moe_intermediate_size=16),
    "c": dict(vocab_size=160, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
              layer_types=[SLIDING] * 5 + [FULL], sliding_window=5, num_attention_heads=2, num_key_value_heads=1,
              head_dim=8, global_head_dim=16, num_global_key_value_heads=1, num_experts=8, top_k_experts=2,
              moe_intermediate_size=8,
              rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 100.0},
                               FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                      "rope_theta": 5000.0}}),
}

COMMON = dict(hidden_size_per_layer_input=0, attention_k_eq_v=True, enable_moe_block=True,
              final_logit_softcapping=30.0, tie_word_embeddings=True, max_position_embeddings=512,
              pad_token_id=0, eos_token_id=1, bos_token_id=2)


def text_kwargs(name: str) -> dict:
    kw = copy.deepcopy(TEXT_CONFIGS[name])
    kw.update(COMMON)
    return kw


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.2) -> torch.nn.Module:
    """Norms/scales/layer_scalar -> 1 + 0.5 N(0,1); every other weight -> std N(0,1). Buffers included."""
    g = torch.Generator().manual_seed(seed)
    seen = set()
    named = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers()
                                              if n.endswith("layer_scalar")]
    for name, t in named:
        if id(t) in seen or not t.is_floating_point():
            continue
        seen.add(id(t))
        scale_like = ("norm" in name or name.endswith("router.scale") or name.endswith("per_expert_scale")
                      or name.endswith("layer_scalar"))
        noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
        t.copy_((1.0 + 0.5 * noise) if scale_like else std * noise)
    return model


def gemma4_causal(name: str = "a", seed: int = 0, std: float = 0.2):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    cfg = Gemma4TextConfig(**text_kwargs(name), attn_implementation="eager", experts_implementation="eager")
    return randomize_(Gemma4ForCausalLM(cfg).eval(), seed, std)


def gemma4_conditional(name: str = "a", seed: int = 0):
    """Multimodal wrapper: the released checkpoint's `model.language_model.*` key layout (no vision tower)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    cfg = Gemma4Config(text_config=text_kwargs(name), vision_config=None, audio_config=None,
                       attn_implementation="eager")
    cfg.text_config._experts_implementation = "eager"
    model = Gemma4ForConditionalGeneration(cfg)
    model.set_experts_implementation("eager") if hasattr(model, "set_experts_implementation") else None
    return randomize_(model.eval(), seed)


def tiny_vision_config():
    from transformers import Gemma4VisionConfig

    return Gemma4VisionConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                              num_key_value_heads=2, head_dim=8, global_head_dim=8, patch_size=4)


def diffusion_gemma(name: str = "a", seed: int = 0, canvas_length: int = 8, untie_scalars: bool = True):
    """Tiny DiffusionGemmaForBlockDiffusion with a tiny vision tower and in-vocab image/boi/eoi ids."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DiffusionGemmaTextConfig

    kw = text_kwargs(name)
    for k in ("hidden_size_per_layer_input", "attention_k_eq_v", "enable_moe_block"):
        kw.pop(k)
    kw["use_bidirectional_attention"] = "vision"
    V = kw["vocab_size"]
    cfg = DiffusionGemmaConfig(text_config=DiffusionGemmaTextConfig(**kw), vision_config=tiny_vision_config(),
                               canvas_length=canvas_length, image_token_id=V - 1, boi_token_id=V - 2,
                               eoi_token_id=V - 3, attn_implementation="eager")
    model = DiffusionGemmaForBlockDiffusion(cfg)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    model = randomize_(model.eval(), seed)
    if not untie_scalars:  # the released checkpoint: encoder and decoder scalar copies are equal
        with torch.no_grad():
            for enc, dec in zip(model.model.encoder.language_model.layers, model.model.decoder.layers):
                enc.layer_scalar.copy_(dec.layer_scalar)
    return model


def left_padded_reference(hf, T: int, pad: int, seed: int = 2):
    """Two random rows of T tokens, row 1 left-padded by `pad` (token 0, attention 0), and the HF causal LM's logits
    on them: (tokens [2, T] int, valid [2, T] bool, logits [2, T, V]) as numpy arrays."""
    tokens = torch.randint(3, hf.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(seed))
    tokens[1, :pad] = 0
    attn = torch.ones(2, T, dtype=torch.long)
    attn[1, :pad] = 0
    with torch.no_grad():
        ref = hf(tokens, attention_mask=attn).logits.numpy()
    return tokens.numpy(), attn.numpy().astype(bool), ref


def greedy_reference(max_new_tokens: int = 12):
    """Gemma 4 config "a" (seed 1, std 0.05: row 1 emits EOS (id 1) mid-way) and its greedy `generate` from two random
    7-token prompts: (hf model, prompts [2, 7] numpy, new tokens [2, <= max_new_tokens] numpy, pad 0)."""
    hf = gemma4_causal("a", seed=1, std=0.05)
    prompt = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=1, pad_token_id=0)
    return hf, prompt.numpy(), ref[:, prompt.shape[1]:].numpy()
