"""Model configuration for the Gemma 4 MoE backbone and its DiffusionGemma modes.

Field names mirror transformers' `Gemma4TextConfig` / `DiffusionGemmaTextConfig` so that a reader can hold the two
side by side. One `ModelConfig` describes one set of weights used in three ways:

* causal "encoder" pass (AR LM, prompt prefill, canvas commit) that writes the KV cache,
* bidirectional "decoder" pass over a canvas that reads the cache (DiffusionGemma denoiser),
* self-conditioning MLP that feeds the previous step's soft prediction into the decoder input.

How the model runs (attention / MoE kernels, layer scan, rematerialisation, dtypes) is a separate frozen
`ExecutionConfig` in `ModelConfig.execution`; `ModelConfig.architecture()` is the config with the default execution.

Presets: `gemma4_26b_a4b()`, `gemma4_e2b()`, `gemma4_e4b()`, `gemma4_31b()` are the released text geometries;
`tiny`, `tiny_toy` are CPU-sized twins of 26B-A4B (MoE, sliding + full layers, K=V full layers, partial proportional
RoPE) and `tiny_e2b`, `tiny_e4b`, `tiny_31b` of the others (per-layer embeddings, KV sharing, double-wide and
dense-only MLPs, full layers with their own V).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Final, Literal

SLIDING: Final = "sliding_attention"  # Final: the type checker sees the literal (a layer-type Literal)
FULL: Final = "full_attention"
TOKAMAX_BACKENDS = ("mosaic", "triton", "xla", "xla_chunked")
LayerType = Literal["sliding_attention", "full_attention"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExecutionConfig:
    """How a `ModelConfig` runs: kernels, layer scan, rematerialisation and dtypes (frozen, hashable).

    None of these change the function the weights compute (up to floating-point rounding), so they are not part of the
    architecture (`ModelConfig.architecture()` drops them). Two of them still shape a checkpoint: `scan_layers` stacks
    the layer parameters per period position ([n_periods, ...]) and `param_dtype` is the parameters' dtype, so the
    checkpoint / conversion code reads them from here.

    Attributes:
      attention_impl: attention implementation (dgemma.model.attention): "dense" materialises [T, S] scores
        (reference, tiny models); "chunked" is pure-JAX flash attention over the mask's structure (no [T, T] array,
        masked tiles skipped, O(T) memory in forward and backward) with query / key chunks of the sizes below;
        "splash" = JAX's Pallas TPU Splash kernel for the one-pass training layout (block sizes = the chunks,
        multiples of 128; the cache paths of inference run "chunked"; dgemma.model.kernels); "tokamax" = Tokamax's
        flash attention (`tokamax_backend`) on every path, given the structured mask as a boolean [T, S] kernel input
        (1 byte per query-key pair, no [T, S] scores)
      attention_q_chunk: query chunk of attention_impl "chunked" / "splash"
      attention_kv_chunk: key chunk of attention_impl "chunked" / "splash"
      moe_impl: MoE dispatch (dgemma.model.moe): "ep" = expert parallelism in shard_map over mesh axis `expert_axis`;
        "sharded" = one sort per device over its own tokens, expert weights gathered; "local" = one sort over the
        array's tokens (the partitioner gathers a sharded batch); "auto" = "ep" iff the active mesh has `expert_axis`
        with size > 1, else "local"
      expert_axis: the mesh axis name that moe_impl "ep" shards the experts over
      moe_kernel: expert matmuls: "xla" = jax.lax.ragged_dot (XLA's lowering); "megablox" = the Pallas TPU grouped
        matmul; "tokamax" = Tokamax's ragged_dot (`tokamax_backend`); "gathered" = plain JAX with each row's expert
        matrix gathered (sparse on any platform; the CPU rehearsal's stand-in); "dense" = every expert on every token
        as plain GEMMs, weighted 0 off the top k (E/k x the routed work; single-device "local" dispatch, no expert
        LoRA; `dgemma.model.moe.dense_experts`: the tiny CPU pipeline's setting); "auto" = per the platform the
        program is for: "tokamax" on GPU (XLA:GPU lowers ragged_dot densely over every expert), "xla" on TPU and CPU
        (`dgemma.model.kernels.resolve_moe_kernel`)
      tokamax_backend: which Tokamax implementation attention_impl / moe_kernel "tokamax" run (the `gpu` extra
        installs it): "mosaic" (Mosaic GPU on Hopper / Blackwell, Mosaic TPU), "triton" (NVIDIA GPUs), "xla" (any
        platform: tests), "xla_chunked" (attention only: Rabe-Staats chunks in plain XLA); a kernel the target
        platform cannot run is a one-line error, never a silent fallback
      kernel_interpret: run Pallas TPU kernels (splash, megablox) in interpret mode: CPU tests and debugging only
      scan_layers: layers as a scan (dgemma.model.scan): the stack runs as `jax.lax.scan` over periods of
        `scan_period` layers (the 26B pattern: 5 sliding + 1 full); parameters are stacked per position in the period
        ([n_periods, ...]); the num_hidden_layers % scan_period last layers run unscanned
      scan_period: layers per scanned period (must divide the layer pattern)
      remat: per-block rematerialisation policy of the backward pass (dgemma.model.scan.REMAT_POLICIES): "none" keeps
        every activation; "full" (alias "block") keeps only each block's input; "save_dots" also keeps the outputs of
        weight matmuls (no attention scores); "offload" keeps those in host memory instead of device memory
      dtype: activation dtype (float32, bfloat16, float16)
      param_dtype: parameter dtype (float32, bfloat16)
    """

    attention_impl: Literal["dense", "chunked", "splash", "tokamax"] = "dense"
    attention_q_chunk: int = 512
    attention_kv_chunk: int = 512
    moe_impl: Literal["auto", "local", "sharded", "ep"] = "auto"
    expert_axis: str = "expert"
    moe_kernel: Literal["xla", "megablox", "tokamax", "gathered", "dense", "auto"] = "xla"
    tokamax_backend: Literal["mosaic", "triton", "xla", "xla_chunked"] = "mosaic"
    kernel_interpret: bool = False
    scan_layers: bool = False
    scan_period: int = 6
    remat: Literal["none", "block", "full", "save_dots", "offload"] = "none"
    dtype: str = "float32"
    param_dtype: str = "float32"

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        def fail(field: str, msg: str):
            raise ValueError(f"ExecutionConfig.{field}: {msg}")

        if self.moe_impl not in ("auto", "local", "sharded", "ep"):
            fail("moe_impl", f"{self.moe_impl!r} is not one of 'auto', 'local', 'sharded', 'ep'")
        if not isinstance(self.expert_axis, str) or not self.expert_axis:
            fail("expert_axis", f"{self.expert_axis!r} must be a mesh axis name")
        remat = ("none", "block", "full", "save_dots", "offload")
        if self.remat not in remat:
            fail("remat", f"{self.remat!r} is not one of {', '.join(map(repr, remat))}")
        if not isinstance(self.scan_period, int) or self.scan_period < 1:
            fail("scan_period", f"{self.scan_period!r} must be a positive integer")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            fail("dtype", f"unsupported activation dtype {self.dtype!r} (float32, bfloat16, float16)")
        if self.param_dtype not in ("float32", "bfloat16"):
            fail("param_dtype", f"unsupported parameter dtype {self.param_dtype!r} (float32, bfloat16)")
        if self.attention_impl not in ("dense", "chunked", "splash", "tokamax"):
            fail("attention_impl", f"{self.attention_impl!r} is not one of 'dense', 'chunked', 'splash', 'tokamax'")
        for name in ("attention_q_chunk", "attention_kv_chunk"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                fail(name, f"{getattr(self, name)!r} must be a positive integer")
            if self.attention_impl == "splash" and getattr(self, name) % 128:
                fail(name, f"{getattr(self, name)} is the Splash block size under attention_impl=splash and must be "
                           f"a multiple of 128 (the TPU lane width)")
        if self.moe_kernel not in ("xla", "megablox", "tokamax", "gathered", "dense", "auto"):
            fail("moe_kernel", f"{self.moe_kernel!r} is not one of 'xla', 'megablox', 'tokamax', 'gathered', 'dense', "
                 f"'auto'")
        if self.tokamax_backend not in TOKAMAX_BACKENDS:
            fail("tokamax_backend", f"{self.tokamax_backend!r} is not one of {', '.join(map(repr, TOKAMAX_BACKENDS))}")
        if self.moe_kernel == "tokamax" and self.tokamax_backend == "xla_chunked":
            fail("tokamax_backend", "'xla_chunked' is an attention implementation; moe_kernel='tokamax' needs "
                                    "'mosaic', 'triton' or 'xla'")


EXECUTION_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ExecutionConfig))
"""The settings that moved from `ModelConfig` into `ModelConfig.execution`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Static hyperparameters of a Gemma 4 MoE / DiffusionGemma model (frozen, hashable): the architecture, plus how
    it runs in `execution` (`ExecutionConfig`)."""

    vocab_size: int = 262_144
    hidden_size: int = 2816
    intermediate_size: int = 2112  # dense MLP that runs alongside the experts; also the self-conditioning width
    num_hidden_layers: int = 30
    num_attention_heads: int = 16
    # sliding-attention layers
    num_key_value_heads: int = 8
    head_dim: int = 256
    # full-attention layers (K = V: no v_proj, V is the raw K projection)
    global_head_dim: int = 512
    num_global_key_value_heads: int = 2
    layer_types: tuple[str, ...] = ()  # empty -> the 26B pattern: 5 sliding + 1 full, repeated
    sliding_window: int = 1024
    # the rest of the family (dgemma.model.per_layer_embeddings, dgemma.model.kv_sharing); defaults = 26B-A4B
    hidden_size_per_layer_input: int = 0  # per-layer embeddings (PLE) width per layer; 0 = no PLE (26B, 31B)
    vocab_size_per_layer_input: int = 262_144  # rows of the PLE table
    num_kv_shared_layers: int = 0  # the last N layers read the K/V of the last non-shared layer of their type
    use_double_wide_mlp: bool = False  # KV-shared layers' dense MLP is 2 * intermediate_size wide (E2B)
    enable_moe_block: bool = True  # False = dense MLP only (E2B, E4B, 31B)
    attention_k_eq_v: bool = True  # full layers use K as V (no v_proj) with num_global_key_value_heads heads
    # MoE
    num_experts: int = 128
    top_k_experts: int = 8
    moe_intermediate_size: int = 704
    # RoPE: default on sliding layers, proportional (partial) on full layers
    rope_theta_sliding: float = 10_000.0
    rope_theta_full: float = 1_000_000.0
    partial_rotary_factor_full: float = 0.25
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float = 30.0
    max_position_embeddings: int = 262_144
    pad_token_id: int = 0
    eos_token_id: tuple[int, ...] = (1, 106, 50)
    bos_token_id: int = 2
    # DiffusionGemma
    canvas_length: int = 256
    self_conditioning: bool = True
    tie_layer_scalar: bool = True  # one learned scalar per layer for both modes; False keeps separate copies
    decoder_sliding: Literal["hf_fixed", "jax_per_query"] = "hf_fixed"
    # how the model runs (kernels, scan, remat, dtypes): not part of the architecture (`ExecutionConfig`)
    execution: ExecutionConfig = ExecutionConfig()

    def __post_init__(self):
        if not self.layer_types:
            pattern = tuple((FULL if (i + 1) % 6 == 0 else SLIDING) for i in range(self.num_hidden_layers))
            object.__setattr__(self, "layer_types", pattern)
        else:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if isinstance(self.eos_token_id, int):
            object.__setattr__(self, "eos_token_id", (self.eos_token_id,))
        else:
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        self.validate()

    def validate(self) -> None:
        def fail(field: str, msg: str):
            raise ValueError(f"ModelConfig.{field}: {msg}")

        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "head_dim", "global_head_dim", "num_experts", "moe_intermediate_size", "max_position_embeddings",
                     "canvas_length"):
            if getattr(self, name) < 1:
                fail(name, f"{getattr(self, name)} must be >= 1")
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0):
            fail("rms_norm_eps", f"{self.rms_norm_eps} must be a finite number > 0")
        if not 0 < self.partial_rotary_factor_full <= 1:
            fail("partial_rotary_factor_full", f"{self.partial_rotary_factor_full} must be in (0, 1]")
        for name in ("rope_theta_sliding", "rope_theta_full"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                fail(name, f"{getattr(self, name)} must be a finite number > 0")
        ids = {"pad_token_id": (self.pad_token_id,), "bos_token_id": (self.bos_token_id,),
               "eos_token_id": self.eos_token_id}
        for name, values in ids.items():
            outside = [i for i in values if not 0 <= i < self.vocab_size]
            if outside or not values:
                fail(name, f"{list(values)} must be non-empty ids in [0, vocab_size={self.vocab_size})")
        if len(self.layer_types) != self.num_hidden_layers:
            fail("layer_types", f"has {len(self.layer_types)} entries but num_hidden_layers={self.num_hidden_layers}")
        bad = [t for t in self.layer_types if t not in (SLIDING, FULL)]
        if bad:
            fail("layer_types", f"unknown layer type(s) {sorted(set(bad))}; expected {SLIDING!r} or {FULL!r}")
        if self.layer_types[-1] != FULL:
            # transformers forces the last Gemma 4 layer to full attention; refuse rather than silently differ.
            fail("layer_types", "the last layer must be 'full_attention' (as transformers' Gemma 4 enforces)")
        for name in ("num_key_value_heads", "num_global_key_value_heads"):
            kv = getattr(self, name)
            if kv <= 0 or self.num_attention_heads % kv:
                fail(name, f"{kv} must divide num_attention_heads={self.num_attention_heads}")
        if not 0 < self.top_k_experts <= self.num_experts:
            fail("top_k_experts", f"{self.top_k_experts} must be in [1, num_experts={self.num_experts}]")
        if self.head_dim % 2 or self.global_head_dim % 2:
            fail("head_dim", "head dims must be even for rotate-half RoPE")
        if self.sliding_window < 2:
            fail("sliding_window", f"{self.sliding_window} must be >= 2")
        if self.decoder_sliding not in ("hf_fixed", "jax_per_query"):
            fail("decoder_sliding", f"{self.decoder_sliding!r} is not one of 'hf_fixed', 'jax_per_query'")
        if not isinstance(self.execution, ExecutionConfig):
            fail("execution", f"{type(self.execution).__name__} is not an ExecutionConfig")
        if self.execution.scan_layers:  # the checks that need both the architecture and the execution settings
            P = self.execution.scan_period
            if not 1 <= P <= self.num_hidden_layers:
                fail("execution.scan_period", f"{P} must be in [1, num_hidden_layers={self.num_hidden_layers}]")
            n = self.num_hidden_layers // P
            odd = [i for i in range(n * P) if self.layer_types[i] != self.layer_types[i % P]]
            if odd:
                fail("execution.scan_period", f"layer_types do not repeat with period {P} (layer {odd[0]} is "
                                              f"{self.layer_types[odd[0]]!r}, layer {odd[0] % P} is "
                                              f"{self.layer_types[odd[0] % P]!r}); scanned layers need a periodic "
                                              f"pattern")
        self._validate_family(fail)

    def _validate_family(self, fail) -> None:
        """PLE / KV sharing / dense-only checks (the features beyond 26B-A4B)."""
        if self.hidden_size_per_layer_input < 0 or self.vocab_size_per_layer_input < 1:
            fail("hidden_size_per_layer_input", f"{self.hidden_size_per_layer_input} (>= 0) with "
                                                f"vocab_size_per_layer_input={self.vocab_size_per_layer_input} (>= 1)")
        if not 0 <= self.num_kv_shared_layers < self.num_hidden_layers:
            fail("num_kv_shared_layers", f"{self.num_kv_shared_layers} must be in [0, num_hidden_layers="
                                         f"{self.num_hidden_layers}): some layer must produce the shared K/V")
        first = self.num_hidden_layers - self.num_kv_shared_layers
        orphans = sorted(set(self.layer_types[first:]) - set(self.layer_types[:first]))
        if orphans:
            fail("num_kv_shared_layers", f"{self.num_kv_shared_layers} shared layers include type(s) {orphans} "
                                         f"that no earlier (non-shared) layer produces")
        if self.use_double_wide_mlp and not self.num_kv_shared_layers:
            fail("use_double_wide_mlp", "widens only KV-shared layers; set num_kv_shared_layers > 0")
        if self.execution.scan_layers and (self.hidden_size_per_layer_input or self.num_kv_shared_layers):
            fail("execution.scan_layers", "scanned layers need identical blocks; per-layer embeddings and KV-shared "
                                          "layers run unscanned (set model.execution.scan_layers=false)")

    # --- per-layer geometry -------------------------------------------------------------------------------------
    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def kv_producer(self, layer: int) -> int | None:
        """The layer whose K/V a KV-shared layer reads (as transformers' `kv_sharing_modes`), None if it has its own."""
        first = self.num_hidden_layers - self.num_kv_shared_layers
        if layer < first:
            return None
        return max(i for i in range(first) if self.layer_types[i] == self.layer_types[layer])

    def layer_has_v_proj(self, layer: int) -> bool:
        return self.is_sliding(layer) or not self.attention_k_eq_v

    def layer_mlp_width(self, layer: int) -> int:
        wide = self.use_double_wide_mlp and self.kv_producer(layer) is not None
        return self.intermediate_size * (2 if wide else 1)

    def layer_head_dim(self, layer: int) -> int:
        return self.head_dim if self.is_sliding(layer) else self.global_head_dim

    def layer_kv_heads(self, layer: int) -> int:
        # transformers applies num_global_key_value_heads to full layers only where attention_k_eq_v is set
        if self.is_sliding(layer) or not self.attention_k_eq_v:
            return self.num_key_value_heads
        return self.num_global_key_value_heads

    def rotary_dims(self, layer: int) -> int:
        """Number of rotated frequency pairs (proportional RoPE rotates only a fraction on full layers)."""
        d = self.layer_head_dim(layer)
        if self.is_sliding(layer):
            return d // 2
        return int(self.partial_rotary_factor_full * d // 2)

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.hidden_size)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def architecture(self) -> "ModelConfig":
        """This config with the default `ExecutionConfig`: what determines the function the weights compute (what
        config.json, export / import and checkpoint-compatibility checks compare)."""
        return dataclasses.replace(self, execution=ExecutionConfig())

    def with_execution(self, **changes) -> "ModelConfig":
        """A copy whose `execution` has `changes` (e.g. `cfg.with_execution(remat="full")`), re-validated."""
        return dataclasses.replace(self, execution=dataclasses.replace(self.execution, **changes))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def gemma4_26b_a4b(**overrides) -> ModelConfig:
    """Presets take architecture overrides plus `execution=ExecutionConfig(...)`. The released Gemma 4 26B-A4B / "
    "DiffusionGemma-26B-A4B geometry (25,233,141,790 text parameters)."""
    return ModelConfig(**overrides)


def tiny(**overrides) -> ModelConfig:
    """CPU test twin: 3 layers [sliding, sliding, full], GQA on both kinds, 4 experts top-2, window 4."""
    base: dict[str, Any] = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        layer_types=(SLIDING, SLIDING, FULL), sliding_window=4, num_experts=4, top_k_experts=2,
        moe_intermediate_size=32, max_position_embeddings=2048, eos_token_id=(1,), canvas_length=8,
    )
    base.update(overrides)
    return ModelConfig(**base)


def tiny_toy(**overrides) -> ModelConfig:
    """Experiment-sized twin (~0.2M params) for the CPU pipeline: 6 layers = one 5 sliding + 1 full period."""
    base: dict[str, Any] = dict(
        vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, sliding_window=16,
        num_experts=8, top_k_experts=2, moe_intermediate_size=32, max_position_embeddings=1024,
        eos_token_id=(1,), canvas_length=8,
    )
    base.update(overrides)
    return ModelConfig(**base)


def gemma4_e2b(**overrides) -> ModelConfig:
    """Gemma 4 E2B (text): PLE width 256, the last 20 of 35 layers KV-shared with a double-wide MLP, dense only."""
    base: dict[str, Any] = dict(
        hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8, num_key_value_heads=1,
        head_dim=256, global_head_dim=512, num_global_key_value_heads=1, sliding_window=512,
        layer_types=tuple(FULL if (i + 1) % 5 == 0 else SLIDING for i in range(35)), hidden_size_per_layer_input=256,
        num_kv_shared_layers=20, use_double_wide_mlp=True, enable_moe_block=False, attention_k_eq_v=False,
        max_position_embeddings=131_072,
    )
    base.update(overrides)
    return ModelConfig(**base)


def gemma4_e4b(**overrides) -> ModelConfig:
    """Gemma 4 E4B (text): PLE width 256, the last 18 of 42 layers KV-shared, dense only."""
    base: dict[str, Any] = dict(
        hidden_size=2560, intermediate_size=10240, num_hidden_layers=42, num_attention_heads=8, num_key_value_heads=2,
        head_dim=256, global_head_dim=512, num_global_key_value_heads=2, sliding_window=512,
        hidden_size_per_layer_input=256, num_kv_shared_layers=18, enable_moe_block=False, attention_k_eq_v=False,
        max_position_embeddings=131_072,
    )
    base.update(overrides)
    return ModelConfig(**base)


def gemma4_31b(**overrides) -> ModelConfig:
    """Gemma 4 31B dense (text): 60 layers, dense MLP 21504, K = V full layers with 4 KV heads, no PLE."""
    base: dict[str, Any] = dict(
        hidden_size=5376, intermediate_size=21504, num_hidden_layers=60, num_attention_heads=32,
        num_key_value_heads=16, head_dim=256, global_head_dim=512, num_global_key_value_heads=4, sliding_window=1024,
        enable_moe_block=False,
    )
    base.update(overrides)
    return ModelConfig(**base)


def _tiny_family(**fields) -> ModelConfig:
    base: dict[str, Any] = dict(vocab_size=128, max_position_embeddings=2048, eos_token_id=(1,), canvas_length=8, head_dim=16,
                global_head_dim=32, sliding_window=4, num_attention_heads=4)
    base.update(fields)
    return ModelConfig(**base)


def tiny_e2b(**overrides) -> ModelConfig:
    """CPU twin of E2B: 5 layers [s, s, f, s, f], the last 2 KV-shared (one of each type) with double-wide MLPs,
    PLE width 8 over a 128-row table, dense only, full layers with their own V and the sliding KV-head count."""
    return _tiny_family(**{**dict(
        hidden_size=64, intermediate_size=48, num_hidden_layers=5, num_key_value_heads=1,
        num_global_key_value_heads=1, layer_types=(SLIDING, SLIDING, FULL, SLIDING, FULL),
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=128, num_kv_shared_layers=2,
        use_double_wide_mlp=True, enable_moe_block=False, attention_k_eq_v=False), **overrides})


def tiny_e4b(**overrides) -> ModelConfig:
    """CPU twin of E4B: 6 layers [s, f, s, s, s, f], the last 3 KV-shared, PLE width 8, GQA 4/2, dense only."""
    return _tiny_family(**{**dict(
        hidden_size=48, intermediate_size=64, num_hidden_layers=6, num_key_value_heads=2,
        num_global_key_value_heads=2, layer_types=(SLIDING, FULL, SLIDING, SLIDING, SLIDING, FULL),
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=128, num_kv_shared_layers=3,
        enable_moe_block=False, attention_k_eq_v=False), **overrides})


def tiny_31b(**overrides) -> ModelConfig:
    """CPU twin of 31B: 4 layers [s, s, s, f], dense MLP only, K = V full layers with their own KV-head count."""
    return _tiny_family(**{**dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_key_value_heads=2,
        num_global_key_value_heads=1, layer_types=(SLIDING, SLIDING, SLIDING, FULL), enable_moe_block=False),
        **overrides})


PRESETS = {"gemma4_26b_a4b": gemma4_26b_a4b, "gemma4_e2b": gemma4_e2b, "gemma4_e4b": gemma4_e4b,
           "gemma4_31b": gemma4_31b, "tiny": tiny, "tiny_toy": tiny_toy, "tiny_e2b": tiny_e2b, "tiny_e4b": tiny_e4b,
           "tiny_31b": tiny_31b}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; available: {sorted(PRESETS)}")
    return PRESETS[name](**overrides)
