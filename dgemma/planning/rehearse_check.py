"""The rehearsal's checks that need a backend, run as child processes of `dgemma rehearse` (each with its own CPU
backend, started here after the device count is set):

    python -m dgemma.planning.rehearse_check params-equal DEVICES A_PARAMS B_PARAMS
    python -m dgemma.planning.rehearse_check export-logits EXPORT_DIR WORK_DIR [CONFIG PARAMS]

`params-equal` restores two params checkpoints (written by `dgemma.checkpoint.params.save_params`) and compares every
leaf bit for bit. `export-logits` loads an HF export in transformers (float32, eager attention and experts) and in
dgemma (`dgemma.convert.hf_import.load_hf_checkpoint`) and compares the canvas logits of one random (prompt, canvas)
batch; for a bfloat16 export with CONFIG and PARAMS (the checkpoint it was exported from) also against the
checkpoint's params rounded to bfloat16, so an export that maps a tensor wrongly fails even when both loaders agree.
An FP8 export is first dequantised (`dgemma.convert.fp8.dequantize`, the block from its config.json) into a
float32 HF directory under WORK_DIR that both sides load: transformers' CPU loader dequantises only its linear layers,
not the fused experts. Each prints one line `OK <figure>` (exit 0) or `FAIL <reason>` (exit 1).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

TOL = 1e-4  # float32 logits of the same weights through two implementations


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
    ref_model, info = tf.DiffusionGemmaForBlockDiffusion.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
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
    with torch.no_grad():
        ref = ref_model(input_ids=prompt, decoder_input_ids=canvas).logits.float().numpy()

    @nnx.jit
    def ours(model, prompt, canvas, cache):
        _, cache = model.encode(prompt, cache)
        return model.logits(model.decode(canvas, cache))

    def logits_of(model):
        cache = KVCache.init(model.cfg, 2, 11 + cfg.canvas_length)
        return np.asarray(ours(model, jnp.asarray(prompt.numpy()), jnp.asarray(canvas.numpy()), cache))

    sides = {"dgemma import": logits_of(model)}
    if config and params and not quantised:  # the trained params themselves, rounded to the export's dtype
        sides["checkpoint"] = logits_of(_checkpoint_model(config, params, "bfloat16"))
    worst = {name: float(np.abs(got - ref).max()) for name, got in sides.items()}
    bad = {k: d for k, d in worst.items() if not d <= TOL}
    if bad:
        raise AssertionError("max |logit difference| " + ", ".join(f"transformers vs {k} {d:.3g}" for k, d in
                                                                   bad.items()) + f" > {TOL:g} (float32)")
    what = "dequantised fp8" if quantised else "bf16"
    vs = " and ".join(f"{k} {d:.1e}" for k, d in worst.items())
    return f"{what}: max |dlogit| transformers vs {vs} over {ref.size:,} logits (<= {TOL:g})"


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
