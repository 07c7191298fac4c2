"""The rehearsal's checks that need a backend, run as child processes of `dgemma rehearse` (each with its own CPU
backend, started here after the device count is set):

    python -m dgemma.planning.rehearse_check params-equal DEVICES A_PARAMS B_PARAMS
    python -m dgemma.planning.rehearse_check export-logits EXPORT_DIR WORK_DIR [CONFIG PARAMS]

`params-equal` restores two params checkpoints (written by `dgemma.checkpoint.params.save_params`) and compares every
leaf bit for bit. `export-logits` loads an HF export in transformers (float32, eager attention and experts) and in
dgemma (`dgemma.convert.hf_import.load_hf_checkpoint`) and compares the canvas logits of one random (prompt, canvas)
batch; for a bfloat16 export with CONFIG and PARAMS (the checkpoint it was exported from) also against the
checkpoint's params rounded to bfloat16, so an export that maps a tensor wrongly fails even when both loaders agree.
transformers routes each token as dgemma did (`_forced_routes`; a choice that differs and is not a float32 tie fails):
at the rehearsal's random init the 128 router probabilities are nearly uniform, and one tie broken the other way moved
a row's logits by 0.0128.
An FP8 export is first dequantised (`dgemma.convert.fp8.dequantize`, the block from its config.json) into a
float32 HF directory under WORK_DIR that both sides load: transformers' CPU loader dequantises only its linear layers,
not the fused experts. Each prints one line `OK <figure>` (exit 0) or `FAIL <reason>` (exit 1).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

TOL = 1e-4  # float32 logits of the same weights through two implementations
TIE = 1e-5  # relative gap under which two router probabilities are a tie that float32 summation order may flip


def params_equal(a: str, b: str) -> str:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    def leaves(path: str) -> dict:
        root = Path(path)
        steps = sorted(int(p.name) for p in root.iterdir() if p.name.isdigit())
        item = root / str(steps[-1]) / "params"
        tree = ocp.PyTreeCheckpointer().restore(item)
        return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}

    la, lb = leaves(a), leaves(b)
    if la.keys() != lb.keys():
        raise AssertionError(f"different params trees ({len(la)} vs {len(lb)} leaves)")
    differ = [k for k in la if la[k].dtype != lb[k].dtype or la[k].tobytes() != lb[k].tobytes()]
    if differ:
        worst = max(differ, key=lambda k: float(np.abs(la[k].astype(np.float64) - lb[k]).max()))
        d = float(np.abs(la[worst].astype(np.float64) - lb[worst]).max())
        raise AssertionError(f"{len(differ)} of {len(la)} leaves differ (largest |d| {d:.3g} in {worst})")
    n = sum(v.size for v in la.values())
    return f"{len(la)} leaves, {n:,} params bit-identical"


def _dequantised_copy(export: Path, work: Path) -> Path:
    """A float32 HF directory with the FP8 export's weights dequantised (config without quantization_config)."""
    import numpy as np
    from safetensors.numpy import save_file

    from dgemma.convert import fp8
    from dgemma.convert.safetensors_io import SafetensorsFile

    conf = json.loads((export / "config.json").read_text())
    qc = conf.pop("quantization_config")
    block = tuple(qc["weight_block_size"])
    out = work / (export.name + "_dequantised")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tensors = {}
    for f in sorted(export.glob("*.safetensors")):
        sf = SafetensorsFile(f)
        raw = {k: sf.read(k) for k in sf.keys()}
        for k, v in raw.items():
            if k.endswith("scale_inv"):
                continue
            if v.dtype == fp8.FP8:
                scale = raw.get(fp8.scale_key(k))
                if scale is None:
                    scale = SafetensorsFile(_shard_of(export, fp8.scale_key(k))).read(fp8.scale_key(k))
                v = fp8.dequantize(v, scale, block)
            tensors[k] = np.ascontiguousarray(v.astype(np.float32))
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(conf, indent=2))
    for extra in ("generation_config.json",):
        if (export / extra).exists():
            shutil.copy(export / extra, out / extra)
    return out


def _shard_of(export: Path, key: str) -> Path:
    index = json.loads((export / "model.safetensors.index.json").read_text())
    return export / index["weight_map"][key]


@contextlib.contextmanager
def _recording_routes(routes: list):
    """dgemma's routers append their top-k expert ids [T, k] to `routes`, in program order, also under jit."""
    import jax
    import numpy as np

    from dgemma.model.moe import Router

    call = Router.__call__

    def recording(self, residual):
        weights, idx = call(self, residual)
        jax.debug.callback(lambda i: routes.append(np.asarray(i)), idx, ordered=True)
        return weights, idx

    Router.__call__ = recording  # type: ignore[method-assign]  # recording the routes of one traced program
    try:
        yield
    finally:
        Router.__call__ = call  # type: ignore[method-assign]


@contextlib.contextmanager
def _forced_routes(tf_router_cls, routes: list, report: dict):
    """transformers' routers take their experts from `routes` (dgemma's, in call order) instead of their own top-k,
    with the weights from their own probabilities. Near-uniform routers (the rehearsal's random init at 128 experts)
    have k-th / (k+1)-th ties that two float32 implementations break differently, and one flipped expert moves a
    row's logits by ~1e-2; with the choices fixed the logits compare the weights alone. Every choice that differs
    from transformers' own must be a tie (probability within TIE of its k-th), else AssertionError: forcing never
    hides a router that maps wrongly. `report` gets the number of routed (token, layer) pairs and of tie flips."""
    import torch

    forward = tf_router_cls.forward
    queue = list(routes)

    def forced(self, hidden_states):
        probs, _, own = forward(self, hidden_states)
        if not queue:
            raise AssertionError("transformers ran more router calls than dgemma")
        idx = torch.from_numpy(queue.pop(0)).to(own.device).long()
        if idx.shape != own.shape:
            raise AssertionError(f"router call {len(routes) - len(queue)}: dgemma routed {tuple(idx.shape)}, "
                                 f"transformers {tuple(own.shape)}")
        chosen = probs.gather(-1, idx)
        kth = probs.gather(-1, own).min(-1).values
        differs = (torch.sort(idx, -1).values != torch.sort(own, -1).values).any(-1)
        if bool((chosen.min(-1).values[differs] < kth[differs] * (1 - TIE)).any()):
            raise AssertionError(f"router call {len(routes) - len(queue)}: dgemma chose experts transformers ranks "
                                 f"below its top-{own.shape[-1]} by more than a tie ({TIE:g} relative)")
        report["routed"] = report.get("routed", 0) + int(own.shape[0])
        report["ties"] = report.get("ties", 0) + int(differs.sum())
        weights = chosen / chosen.sum(-1, keepdim=True) * self.per_expert_scale[idx]
        return probs, weights, idx

    tf_router_cls.forward = forced
    try:
        yield
        if queue:
            raise AssertionError(f"dgemma ran {len(queue)} more router calls than transformers")
    finally:
        tf_router_cls.forward = forward


def export_logits(export: str, work: str | None, config: str | None = None, params: str | None = None) -> str:
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers as tf
    from flax import nnx

    from dgemma.convert.hf_import import load_hf_checkpoint
    from dgemma.model.cache import KVCache

    path = Path(export)
    quantised = "quantization_config" in json.loads((path / "config.json").read_text())
    if quantised:
        path = _dequantised_copy(path, Path(work or path.parent))
    # output_loading_info=True returns (model, loading info); transformers annotates the model alone
    loaded: Any = tf.DiffusionGemmaForBlockDiffusion.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    ref_model, info = loaded
    # a text-only export leaves transformers' vision tower initialised; every text weight must come from the files
    text_missing = [k for k in info["missing_keys"] if "vision" not in k]
    if text_missing or info["unexpected_keys"] or info["mismatched_keys"]:
        raise AssertionError(f"transformers' load of {path}: missing {text_missing[:3]}, unexpected "
                             f"{list(info['unexpected_keys'])[:3]}, mismatched {list(info['mismatched_keys'])[:3]}")
    ref_model.set_experts_implementation("eager")
    ref_model.eval()
    model, _ = load_hf_checkpoint(path, dtype="float32", param_dtype="float32")
    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, cfg.vocab_size - 3, (2, 11), generator=g)
    canvas = torch.randint(0, cfg.vocab_size - 3, (2, cfg.canvas_length), generator=g)
    def ours(model, prompt, canvas, cache):
        _, cache = model.encode(prompt, cache)
        return model.logits(model.decode(canvas, cache))

    def compare(model) -> tuple[float, dict]:
        """max |Δlogit| of `model` against transformers routed as `model` routed (`_forced_routes`)."""
        routes: list[np.ndarray] = []
        report: dict = {}
        cache = KVCache.init(model.cfg, 2, 11 + cfg.canvas_length)
        with _recording_routes(routes):  # traced here, so the recording is in this program
            got = np.asarray(nnx.jit(ours)(model, jnp.asarray(prompt.numpy()), jnp.asarray(canvas.numpy()), cache))
        router_cls = type(next(m for m in ref_model.modules() if type(m).__name__.endswith("TextRouter")))
        with torch.no_grad(), _forced_routes(router_cls, routes, report):
            ref = ref_model(input_ids=prompt, decoder_input_ids=canvas).logits.float().numpy()
        return float(np.abs(got - ref).max()), report

    sides = {"dgemma import": compare(model)}
    if config and params and not quantised:  # the trained params themselves, rounded to the export's dtype
        sides["checkpoint"] = compare(_checkpoint_model(config, params, "bfloat16"))
    worst = {name: d for name, (d, _) in sides.items()}
    bad = {k: d for k, d in worst.items() if not d <= TOL}
    if bad:
        raise AssertionError("max |logit difference| " + ", ".join(f"transformers vs {k} {d:.3g}" for k, d in
                                                                   bad.items()) + f" > {TOL:g} (float32)")
    what = "dequantised fp8" if quantised else "bf16"
    vs = " and ".join(f"{k} {d:.1e}" for k, d in worst.items())
    _, rep = sides["dgemma import"]
    ties = (f"; routing: {rep['ties']} of {rep['routed']:,} (token, layer) choices were ties, taken as dgemma "
            f"took them" if rep.get("routed") else "")
    return f"{what}: max |dlogit| transformers vs {vs} over {canvas.numel() * cfg.vocab_size:,} logits (<= {TOL:g})" + ties


def _checkpoint_model(config: str, params: str, dtype: str):
    """The config's model (float32 execution) with the params checkpoint's weights rounded through `dtype`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dgemma.checkpoint.params import restore_params
    from dgemma.config import load_config
    from dgemma.model.transformer import abstract_model, model_from_params

    model_cfg = load_config(config, env={}).model_config.with_execution(dtype="float32", param_dtype="float32")
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                          nnx.state(abstract_model(model_cfg), nnx.Param))
    state = restore_params(params, target)
    state = jax.tree.map(lambda x: x.astype(dtype).astype(jnp.float32), state)
    return model_from_params(model_cfg, state)


def main(argv: list[str]) -> int:
    import jax

    try:
        if argv[:1] == ["params-equal"] and len(argv) == 4:
            # the checkpoints were written from this many devices: restore them onto as many (before the backend)
            jax.config.update("jax_num_cpu_devices", int(argv[1]))
            line = params_equal(argv[2], argv[3])
        elif argv[:1] == ["export-logits"] and len(argv) in (3, 5):
            line = export_logits(*argv[1:])
        else:
            print("FAIL usage: params-equal DEVICES A B | export-logits EXPORT_DIR WORK_DIR [CONFIG PARAMS]")
            return 2
    except Exception as e:  # noqa: BLE001 - the parent prints this child's one line
        print(f"FAIL {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400])
        return 1
    print(f"OK {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
