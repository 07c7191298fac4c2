"""The one table between Hugging Face tensor names and dgemma parameter paths (both directions).

HF stores linear weights as [out, in]; dgemma stores [in, out] with heads split out, experts as [E, in, out]:

| HF suffix (after the text prefix)                 | HF shape      | dgemma path                          | shape       |
|---------------------------------------------------|---------------|--------------------------------------|-------------|
| embed_tokens.weight                               | [V, H]        | embedder.embedding                   | [V, H]      |
| norm.weight                                       | [H]           | final_norm.scale                     | [H]         |
| layers.N.input_layernorm.weight                   | [H]           | layers.N.pre_attn_norm.scale         | [H]         |
| layers.N.post_attention_layernorm.weight          | [H]           | layers.N.post_attn_norm.scale        | [H]         |
| layers.N.pre_feedforward_layernorm.weight         | [H]           | layers.N.pre_mlp_norm.scale          | [H]         |
| layers.N.post_feedforward_layernorm_1.weight      | [H]           | layers.N.post_mlp_norm.scale         | [H]         |
| layers.N.pre_feedforward_layernorm_2.weight       | [H]           | layers.N.moe.pre_norm.scale          | [H]         |
| layers.N.post_feedforward_layernorm_2.weight      | [H]           | layers.N.moe.post_norm.scale         | [H]         |
| layers.N.post_feedforward_layernorm.weight        | [H]           | layers.N.post_ffw_norm.scale         | [H]         |
| layers.N.layer_scalar                             | [1]           | layers.N.layer_scalar                | [1]         |
| layers.N.self_attn.{q,k,v}_proj.weight            | [n*D, H]      | layers.N.attn.{q,k,v}_proj           | [H, n, D]   |
| layers.N.self_attn.o_proj.weight                  | [H, N*D]      | layers.N.attn.o_proj                 | [N, D, H]   |
| layers.N.self_attn.{q,k}_norm.weight              | [D]           | layers.N.attn.{q,k}_norm.scale       | [D]         |
| layers.N.mlp.{gate,up}_proj.weight                | [I, H]        | layers.N.mlp.{gate,up}               | [H, I]      |
| layers.N.mlp.down_proj.weight                     | [H, I]        | layers.N.mlp.down                    | [I, H]      |
| layers.N.router.proj.weight                       | [E, H]        | layers.N.moe.router.proj             | [H, E]      |
| layers.N.router.{scale,per_expert_scale}          | [H], [E]      | layers.N.moe.router.{...}            | same        |
| layers.N.experts.gate_up_proj                     | [E, 2I, H]    | layers.N.moe.experts.{gate,up}       | [E, H, I] x2|
| layers.N.experts.down_proj                        | [E, H, I]     | layers.N.moe.experts.down            | [E, I, H]   |
| embed_tokens_per_layer.weight                     | [Vp, L*P]     | per_layer_embedder.table             | [Vp, L*P]   |
| per_layer_model_projection.weight                 | [L*P, H]      | per_layer_embedder.model_projection  | [H, L*P]    |
| per_layer_projection_norm.weight                  | [P]           | per_layer_embedder.projection_norm.scale | [P]     |
| layers.N.per_layer_input_gate.weight              | [P, H]        | layers.N.per_layer_gate.gate         | [H, P]      |
| layers.N.per_layer_projection.weight              | [H, P]        | layers.N.per_layer_gate.projection   | [P, H]      |
| layers.N.post_per_layer_input_norm.weight         | [H]           | layers.N.per_layer_gate.post_norm.scale | [H]      |
| self_conditioning.pre_norm.weight                 | [H]           | self_conditioning.pre_norm.scale     | [H]         |
| self_conditioning.{gate,up}_proj.weight           | [I, H]        | self_conditioning.mlp.{gate,up}      | [H, I]      |
| self_conditioning.down_proj.weight                | [H, I]        | self_conditioning.mlp.down           | [I, H]      |

(Names are crossed between libraries: HF `mlp` is the dense MLP and `experts` the MoE; `_1`/`_2` norm suffixes are
the dense/MoE branches.) `lm_head` is tied to the embedding and never stored. The per-layer-embedding rows exist only
with `hidden_size_per_layer_input > 0`; dense-only models (`enable_moe_block=false`) have no router, experts or
`_1`/`_2` norms; KV-shared layers have no k/v projections or k_norm (transformers ignores them on load:
`kv_shared_unused` names those, which the importer skips).

Scanned models (`model.execution.scan_layers`, `dgemma.model.scan`) store layer N < n*P as index N // P of the stacked
`scan_blocks.(N % P).<same suffix>` ([n, ...shape above]) and the tail layers as `tail_blocks.(N - n*P)`. The table
above stays the one table: `per_layer_params` presents a scanned model's parameters under the per-layer paths
(slices, fetched lazily), and `scanned_params` stacks per-layer arrays into the scanned layout.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:
    from dgemma.model.config import ModelConfig

Path = tuple  # dgemma state path, e.g. ("layers", 3, "attn", "q_proj")


@dataclasses.dataclass(frozen=True)
class Rule:
    """HF tensor <-> one or more dgemma arrays. `to_dgemma(hf_array, shapes) -> [arrays]`, `to_hf([arrays])`."""

    pattern: re.Pattern
    paths: Callable[[re.Match], list[Path]]
    to_dgemma: Callable[[np.ndarray, list[tuple]], list[np.ndarray]]
    to_hf: Callable[[list[np.ndarray]], np.ndarray]


def _same(a, shapes):
    return [a]


def _same_back(arrs):
    return arrs[0]


def _linear(a, shapes):  # HF [out, in] -> dgemma [in, ...out split]
    return [np.ascontiguousarray(a.T).reshape(shapes[0])]


def _linear_back(arrs):
    a = arrs[0]
    return np.ascontiguousarray(a.reshape(a.shape[0], -1).T)


def _o_proj(a, shapes):  # HF [H, N*D] -> [N, D, H]
    return [np.ascontiguousarray(a.T).reshape(shapes[0])]


def _o_proj_back(arrs):
    a = arrs[0]
    return np.ascontiguousarray(a.reshape(-1, a.shape[-1]).T)


def _gate_up(a, shapes):  # [E, 2I, H] -> gate, up [E, H, I]
    inter = a.shape[1] // 2
    return [np.ascontiguousarray(a[:, :inter].transpose(0, 2, 1)), np.ascontiguousarray(a[:, inter:].transpose(0, 2, 1))]


def _gate_up_back(arrs):
    return np.ascontiguousarray(np.concatenate([arrs[0], arrs[1]], axis=2).transpose(0, 2, 1))


def _swap_last(a, shapes):  # [E, H, I] <-> [E, I, H]
    return [np.ascontiguousarray(a.transpose(0, 2, 1))]


def _swap_last_back(arrs):
    return np.ascontiguousarray(arrs[0].transpose(0, 2, 1))


def _rule(regex, paths, fwd=_same, back=_same_back):
    return Rule(re.compile(regex), paths, fwd, back)


_NORMS = {
    "input_layernorm": ("pre_attn_norm",),
    "post_attention_layernorm": ("post_attn_norm",),
    "pre_feedforward_layernorm": ("pre_mlp_norm",),
    "post_feedforward_layernorm_1": ("post_mlp_norm",),
    "pre_feedforward_layernorm_2": ("moe", "pre_norm"),
    "post_feedforward_layernorm_2": ("moe", "post_norm"),
    "post_feedforward_layernorm": ("post_ffw_norm",),
}


def _layer(m):
    return ("layers", int(m.group(1)))


RULES: list[Rule] = [
    _rule(r"embed_tokens\.weight", lambda m: [("embedder", "embedding")]),
    _rule(r"norm\.weight", lambda m: [("final_norm", "scale")]),
    _rule(r"layers\.(\d+)\.(" + "|".join(_NORMS) + r")\.weight",
          lambda m: [_layer(m) + _NORMS[m.group(2)] + ("scale",)]),
    _rule(r"layers\.(\d+)\.layer_scalar", lambda m: [_layer(m) + ("layer_scalar",)]),
    _rule(r"layers\.(\d+)\.self_attn\.([qkv])_proj\.weight", lambda m: [_layer(m) + ("attn", f"{m.group(2)}_proj")],
          _linear, _linear_back),
    _rule(r"layers\.(\d+)\.self_attn\.o_proj\.weight", lambda m: [_layer(m) + ("attn", "o_proj")],
          _o_proj, _o_proj_back),
    _rule(r"layers\.(\d+)\.self_attn\.([qk])_norm\.weight", lambda m: [_layer(m) + ("attn", f"{m.group(2)}_norm", "scale")]),
    _rule(r"layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", lambda m: [_layer(m) + ("mlp", m.group(2))],
          _linear, _linear_back),
    _rule(r"layers\.(\d+)\.router\.proj\.weight", lambda m: [_layer(m) + ("moe", "router", "proj")],
          _linear, _linear_back),
    _rule(r"layers\.(\d+)\.router\.(scale|per_expert_scale)", lambda m: [_layer(m) + ("moe", "router", m.group(2))]),
    _rule(r"layers\.(\d+)\.experts\.gate_up_proj",
          lambda m: [_layer(m) + ("moe", "experts", "gate"), _layer(m) + ("moe", "experts", "up")],
          _gate_up, _gate_up_back),
    _rule(r"layers\.(\d+)\.experts\.down_proj", lambda m: [_layer(m) + ("moe", "experts", "down")],
          _swap_last, _swap_last_back),
    _rule(r"embed_tokens_per_layer\.weight", lambda m: [("per_layer_embedder", "table")]),
    _rule(r"per_layer_model_projection\.weight", lambda m: [("per_layer_embedder", "model_projection")],
          _linear, _linear_back),
    _rule(r"per_layer_projection_norm\.weight", lambda m: [("per_layer_embedder", "projection_norm", "scale")]),
    _rule(r"layers\.(\d+)\.per_layer_input_gate\.weight", lambda m: [_layer(m) + ("per_layer_gate", "gate")],
          _linear, _linear_back),
    _rule(r"layers\.(\d+)\.per_layer_projection\.weight", lambda m: [_layer(m) + ("per_layer_gate", "projection")],
          _linear, _linear_back),
    _rule(r"layers\.(\d+)\.post_per_layer_input_norm\.weight",
          lambda m: [_layer(m) + ("per_layer_gate", "post_norm", "scale")]),
    _rule(r"self_conditioning\.pre_norm\.weight", lambda m: [("self_conditioning", "pre_norm", "scale")]),
    _rule(r"self_conditioning\.(gate|up|down)_proj\.weight", lambda m: [("self_conditioning", "mlp", m.group(1))],
          _linear, _linear_back),
]


def match(suffix: str) -> tuple[Rule, list[Path]] | None:
    for rule in RULES:
        m = rule.pattern.fullmatch(suffix)
        if m:
            return rule, rule.paths(m)
    return None


_MOE_NORMS = ("post_feedforward_layernorm_1", "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2")
_KV_SHARED_UNUSED = re.compile(r"layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.weight")


def kv_shared_unused(cfg: ModelConfig, suffix: str) -> bool:
    """A K/V tensor of a KV-shared layer: transformers ignores it on load (`_keys_to_ignore_on_load_unexpected`)."""
    m = _KV_SHARED_UNUSED.fullmatch(suffix)
    return m is not None and int(m.group(1)) < cfg.num_hidden_layers and cfg.kv_producer(int(m.group(1))) is not None


def hf_text_suffixes(cfg: ModelConfig) -> list[str]:
    """Every text tensor suffix a complete checkpoint of `cfg` holds (export order)."""
    out = ["embed_tokens.weight"]
    if cfg.hidden_size_per_layer_input:
        out += ["embed_tokens_per_layer.weight", "per_layer_model_projection.weight",
                "per_layer_projection_norm.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shared = cfg.kv_producer(i) is not None
        out += [p + "layer_scalar"]
        out += [p + f"{n}.weight" for n in _NORMS if cfg.enable_moe_block or n not in _MOE_NORMS]
        out += [p + f"self_attn.{x}_proj.weight" for x in ("q", "k", "v", "o")
                if not (shared and x in "kv") and (x != "v" or cfg.layer_has_v_proj(i))]
        out += [p + "self_attn.q_norm.weight"] + ([] if shared else [p + "self_attn.k_norm.weight"])
        out += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        if cfg.enable_moe_block:
            out += [p + "router.proj.weight", p + "router.scale", p + "router.per_expert_scale"]
            out += [p + "experts.gate_up_proj", p + "experts.down_proj"]
        if cfg.hidden_size_per_layer_input:
            out += [p + "per_layer_input_gate.weight", p + "per_layer_projection.weight",
                    p + "post_per_layer_input_norm.weight"]
    out.append("norm.weight")
    return out


def self_conditioning_suffixes() -> list[str]:
    return ["self_conditioning.pre_norm.weight"] + [f"self_conditioning.{x}_proj.weight" for x in ("gate", "up", "down")]


# MARK: scanned layout ------------------------------------------------------------------------------------------
class LayerSlice:
    """Layer `index` of a stacked parameter, read lazily (`x[...]` slices on the device; `shape` without reading)."""

    def __init__(self, stacked, index: int):
        self.stacked, self.index = stacked, index
        self.shape = tuple(stacked.shape[1:])
        self.dtype = stacked.dtype

    def __getitem__(self, item):
        return self.stacked[...][self.index][item]


def per_layer_params(cfg: ModelConfig, flat: dict) -> dict:
    """{path: Variable} of a model's params under per-layer paths (`layers.N...`), whatever its layout."""
    if not cfg.execution.scan_layers:
        return flat
    from dgemma.model.scan import scan_geometry

    P, n, _ = scan_geometry(cfg)
    out = {}
    for path, var in flat.items():
        if path[:1] == ("scan_blocks",):
            for p in range(n):
                out[("layers", p * P + int(path[1]), *path[2:])] = LayerSlice(var, p)
        elif path[:1] == ("tail_blocks",):
            out[("layers", n * P + int(path[1]), *path[2:])] = var
        else:
            out[path] = var
    return out


def scanned_params(cfg: ModelConfig, flat: dict) -> dict:
    """{per-layer path: array} -> {path of `cfg`'s layout: array} (stacks the scanned layers; identity otherwise)."""
    if not cfg.execution.scan_layers:
        return flat
    from dgemma.model.scan import stack_state

    return stack_state(cfg, flat)
