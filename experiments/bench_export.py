"""Benchmark: HF export throughput (MB/s) and peak RSS / model bytes for a >= 2 GB random dgemma model.

    python experiments/bench_export.py                   # all methods, each in a fresh subprocess
    python experiments/bench_export.py --layers 4        # smaller model (smoke run)

Methods (each run in its own fresh process, on the same model built from the same seed):
  streaming  `export_hf` (this repo): shard plan from shapes, one tensor in flight, sha256 while writing, fsync.
  streaming_nofsync  the same with `os.fsync` stubbed out (like-for-like with the two below, which never fsync).
  previous   `export_hf` at git HEAD~ (read with `git show`, if available): fp32 detour per tensor, one whole shard
             buffered in memory, sha256 by re-reading the files, no fsync.
  naive      `jax.device_get` of the whole state, every HF tensor converted into one dict, then written shard by shard
             with `write_safetensors` (the obvious baseline).
RSS is sampled every 5 ms by a thread during the export only; "extra" = peak - RSS just before the export.
torch + transformers are imported before the measurement in every method (a fixed ~0.4 GB, not model-dependent).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def model_config(layers: int):
    from dgemma.model.config import FULL, SLIDING, ExecutionConfig, ModelConfig

    return ModelConfig(vocab_size=65_536, hidden_size=1024, intermediate_size=768, num_hidden_layers=layers,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=128, global_head_dim=256,
                       num_global_key_value_heads=1, num_experts=32, top_k_experts=4, moe_intermediate_size=512,
                       sliding_window=512, max_position_embeddings=8192, canvas_length=256,
                       layer_types=tuple(FULL if (i + 1) % 6 == 0 or i == layers - 1 else SLIDING
                                         for i in range(layers)),
                       execution=ExecutionConfig(param_dtype="bfloat16", dtype="bfloat16"))


class RssSampler:
    def __init__(self, period=0.005):
        import psutil

        self.proc, self.period, self.peak, self._stop = psutil.Process(), period, 0, threading.Event()

    def __enter__(self):
        self.start = self.proc.memory_info().rss
        self.peak = self.start
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.period)

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


def naive_export(model, out: Path, max_shard: int):
    import hashlib

    import jax
    import numpy as np
    from flax import nnx

    from dgemma.convert import keymap
    from dgemma.convert.safetensors_io import write_safetensors

    out.mkdir(parents=True)
    host = jax.device_get(nnx.state(model, nnx.Param))  # the whole model on the host, at once
    flat = {tuple(p): np.asarray(v[...]) for p, v in nnx.to_flat_state(host)}
    tensors = {}
    for suffix in keymap.hf_text_suffixes(model.cfg) + keymap.self_conditioning_suffixes():
        rule, paths = keymap.match(suffix)
        tensors["model.decoder." + suffix] = rule.to_hf([flat[p] for p in paths])
    for i in range(model.cfg.num_hidden_layers):
        tensors[f"model.encoder.language_model.layers.{i}.layer_scalar"] = flat[("layers", i, "layer_scalar")]
    shard, size, n = {}, 0, 0
    for k, a in tensors.items():
        if shard and size + a.nbytes > max_shard:
            write_safetensors(out / f"shard{n}.safetensors", shard)
            shard, size, n = {}, 0, n + 1
        shard[k], size = a, size + a.nbytes
    write_safetensors(out / f"shard{n}.safetensors", shard)
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()}


def previous_export_module():
    """`dgemma/convert/hf_export.py` as of the commit before this benchmark's export rewrite (None if unavailable)."""
    import importlib.util

    try:
        src = subprocess.run(["git", "-C", str(REPO), "show", "aec5513:dgemma/convert/hf_export.py"],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    path = Path(tempfile.mkdtemp()) / "hf_export_previous.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("hf_export_previous", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def worker(method: str, layers: int, out: Path, max_shard: int) -> dict:
    import jax
    from flax import nnx

    from dgemma.model.transformer import Transformer

    t0 = time.perf_counter()
    model = Transformer(model_config(layers), rngs=nnx.Rngs(0))
    jax.block_until_ready(nnx.state(model))
    build_s = time.perf_counter() - t0
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    # transformers' config / generation-config classes pull in torch: a fixed ~0.4 GB that every HF export pays
    # whatever the model size; imported first so the figures measure what scales with the model.
    import torch  # noqa: F401
    from transformers.models.diffusion_gemma import generation_diffusion_gemma  # noqa: F401

    if method == "streaming_nofsync":  # same code, durability off: isolates the cost of fsync on this disk
        os.fsync = lambda fd: None
    if method == "previous":
        prev = previous_export_module()
        if prev is None:
            return {"method": method, "skipped": "git history unavailable"}
    with RssSampler() as rss:
        t0 = time.perf_counter()
        if method.startswith("streaming"):
            from dgemma.convert.hf_export import export_hf

            export_hf(model, out, max_shard_size=max_shard)
        elif method == "previous":
            prev.export_hf(model, out, max_shard_size=max_shard)
        else:
            naive_export(model, out, max_shard)
        secs = time.perf_counter() - t0
    written = sum(p.stat().st_size for p in out.iterdir() if p.name.endswith(".safetensors"))
    return {"method": method, "model_bytes": model_bytes, "written_bytes": written, "seconds": secs,
            "mb_per_s": written / 1e6 / secs, "rss_before": rss.start, "rss_peak": rss.peak,
            "peak_over_model": rss.peak / model_bytes, "extra_over_model": (rss.peak - rss.start) / model_bytes,
            "build_seconds": build_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--max-shard-mb", type=int, default=1024)
    ap.add_argument("--methods", default="streaming,streaming_nofsync,previous,naive")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.layers, Path(args.out), args.max_shard_mb << 20)))
        return
    import psutil

    rows = []
    for method in args.methods.split(","):
        tmp = Path(tempfile.mkdtemp(prefix="bench_export_"))
        env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
        res = subprocess.run([sys.executable, __file__, "--worker", method, "--layers", str(args.layers),
                              "--max-shard-mb", str(args.max_shard_mb), "--out", str(tmp / "out")],
                             capture_output=True, text=True, env=env)
        shutil.rmtree(tmp, ignore_errors=True)
        line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
        if res.returncode or not line:
            print(f"{method}: failed\n{res.stderr[-2000:]}")
            continue
        rows.append(json.loads(line[0][7:]))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{psutil.virtual_memory().total / 2**30:.1f} GiB RAM, python {platform.python_version()}")
    base = next((r for r in rows if r["method"] == "naive" and "seconds" in r), None)
    print(f"{'method':<17} {'model GB':>8} {'written GB':>10} {'s':>7} {'MB/s':>7} {'RSS pre GB':>10} "
          f"{'peak GB':>8} {'peak/model':>10} {'extra/model':>11} {'x naive MB/s':>12}")
    for r in rows:
        if "seconds" not in r:
            print(f"{r['method']:<17} skipped: {r.get('skipped')}")
            continue
        speed = r["mb_per_s"] / base["mb_per_s"] if base else float("nan")
        print(f"{r['method']:<17} {r['model_bytes'] / 1e9:8.2f} {r['written_bytes'] / 1e9:10.2f} {r['seconds']:7.1f} "
              f"{r['mb_per_s']:7.0f} {r['rss_before'] / 1e9:10.2f} {r['rss_peak'] / 1e9:8.2f} "
              f"{r['peak_over_model']:10.2f} {r['extra_over_model']:11.2f} {speed:12.2f}")
    print("JSON " + json.dumps(rows))


if __name__ == "__main__":
    main()
