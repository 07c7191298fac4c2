"""Run checkpoints of an adapted run (`dgemma.train.lora_checkpoint`) through the real trainer: they hold the trainable
leaves (not the base), an interrupted run resumes bit-identical to a straight one, a resume over another base is a
one-line refusal that writes nothing."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs/stage1/tiny.yaml")
STEPS = 4


def _cfg(out, *overrides):
    from dgemma.config import load_config

    return load_config(TINY, [f"run.output_dir={out}", f"trainer.steps={STEPS}", "trainer.eval_every=0",
                              "trainer.log_every=1", "checkpoint.every=2", "checkpoint.async_save=false",
                              "data.batch_size=4", "optim.warmup_steps=0", "model.num_hidden_layers=2",
                              "trainer.objective=ar",
                              "model.layer_types=[sliding_attention, full_attention]", "lora.rank=2",
                              "lora.alpha=4.0", "lora.dropout=0.2", "lora.targets=['attn/[qv]_proj$', 'experts/gate$']",
                              *overrides], env={})


def _one_device():
    from dgemma.parallel.mesh import make_mesh

    return make_mesh({"fsdp": 1}, jax.devices()[:1])


def _train(cfg, **kw):
    from dgemma.train.trainer import train

    return train(cfg, progress=False, mesh=_one_device(), **kw)


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _tree_bytes(tree) -> dict[str, bytes]:
    return {jax.tree_util.keystr(p): np.asarray(x).tobytes() for p, x in jax.tree_util.tree_leaves_with_path(tree)}


class Stop(Exception):
    pass


def _stop_at(n):
    def on_step(step, metrics):
        if step == n:
            raise Stop

    return on_step


def test_adapter_checkpoints_are_small_and_resume_exactly(tmp_path):
    from dgemma.checkpoint import CheckpointManager

    straight = _train(_cfg(tmp_path / "a"))
    run = Path(straight.run_dir)
    ckpt_dir = run / "checkpoints"
    with CheckpointManager(ckpt_dir) as ckpt:
        md = ckpt.metadata(STEPS)
    assert md["lora_base"]["init_from"] is None and len(md["lora_base"]["sums"]) == 3
    # the step holds the adapters and the optimizer state only: far below the full params written at the end
    step_bytes, full_bytes = _bytes(ckpt_dir / str(STEPS)), _bytes(run / "params")
    assert step_bytes < 0.3 * full_bytes, (step_bytes, full_bytes)

    _check_params_load_merged(straight, run)

    cfg = _cfg(tmp_path / "b")
    with pytest.raises(Stop):
        _train(cfg, on_step=_stop_at(3))
    resumed = _train(cfg)
    assert resumed.resumed and resumed.start_step == 2 and resumed.steps_run == 2
    a, b = _tree_bytes(straight.state), _tree_bytes(resumed.state)
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a)
    params = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(resumed.state.params)}
    assert any("/lora/" in p for p in params) and any(p.endswith("attn/q_proj") for p in params)


def _check_params_load_merged(summary, run: Path):
    """The run's params (base + adapters, `lora` in their metadata) load for sampling / evaluation / export as the
    config's plain model with the adapters folded in: the trained LoRA model's logits (`dgemma sample` / `eval` on
    such params: tests/convert/test_lora_export.py)."""
    from support import jitted as J
    from dgemma.checkpoint.model import restore_model
    from dgemma.train.lora_setup import adapted_factory
    from dgemma.train.trainer import _default_model_factory

    cfg = _cfg(run.parent)
    trained = adapted_factory(cfg, _default_model_factory(cfg.model_config))(nnx.Rngs(0))
    nnx.update(trained, summary.state.params)
    loaded, params = restore_model(cfg.model_config, run / "params", mesh=_one_device(), rules=cfg.mesh.rules)
    assert not nnx.state(loaded, nnx.LoRAParam) and not any("/lora/" in "/".join(map(str, p))
                                                            for p, _ in nnx.to_flat_state(params))
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, cfg.model_config.vocab_size)
    np.testing.assert_allclose(np.asarray(J.forward(loaded, tokens)), np.asarray(J.forward(trained, tokens)),
                               atol=1e-5, rtol=0)


def test_resume_over_another_base_is_refused(tmp_path):
    from dgemma.config import ConfigError

    cfg = _cfg(tmp_path)
    with pytest.raises(Stop):
        _train(cfg, on_step=_stop_at(3))
    run = Path(cfg.run.run_dir)
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    other = _cfg(tmp_path, "run.seed=7")  # the base is the seed's initialisation: another seed, another base
    with pytest.raises(ConfigError, match=r"^invalid config: checkpoint step 2 in .*checkpoints was written over another base "
                                          r"\(checkpoint.init_from=None, seed 0\) than this run's .*seed 7") as e:
        _train(other)
    assert "\n" not in str(e.value)
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before  # nothing written
