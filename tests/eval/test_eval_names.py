"""One quantity, one name: the periodic evaluation of the stage-0/1 trainer (`PeriodicEval`) and the SD·RL periodic
evaluation (`dgemma.train.sdrl.evaluation.evaluate`) both go through `dgemma.eval.evaluator`, so on the same weights,
held-out batches and key they log the full-K_max diffusion decoding under the same `eval/diffusion/...` names with
the same values."""

from __future__ import annotations

import jax
from flax import nnx


def test_periodic_eval_and_sdrl_evaluate_share_names_and_values(tmp_path):
    from dgemma.config import load_config
    from dgemma.model.transformer import Transformer
    from dgemma.train.periodic_eval import PeriodicEval
    from dgemma.train.sdrl import evaluation as sdrl_metrics

    cfg = load_config(None, {
        "run.output_dir": str(tmp_path), "model.preset": "tiny", "model.vocab_size": 32, "model.num_hidden_layers": 2,
        "model.layer_types": ["sliding_attention", "full_attention"], "trainer.steps": 1, "trainer.eval_every": 1,
        "trainer.eval_batches": 1, "data.layout": {"prompt_len": 16, "n_blocks": 2}, "data.batch_size": 4,
        "data.num_threads": 0, "sampler.max_steps": 2}, env={})
    model = Transformer(cfg.model_config, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    periodic = PeriodicEval(cfg, graphdef, t_grid=(0.5,))  # one noise level: the denoising metrics are not compared
    logged = periodic(state, step=3)
    tok = periodic.held_out.tokenizer
    sdrl = sdrl_metrics.evaluate(model, periodic.held_out, cfg, 1, jax.random.fold_in(jax.random.key(cfg.run.seed), 3),
                                 eos_ids=tok.stop_ids, pad_id=tok.pad_id)
    shared = {k for k in logged if k.startswith("eval/diffusion/")}
    assert {"eval/diffusion/exact_match", "eval/diffusion/exact_match/copy", "eval/diffusion/tpf",
            "eval/diffusion/steps_per_block", "eval/diffusion/max_steps"} <= shared
    assert shared == {k for k in sdrl if k.startswith("eval/diffusion/")}
    assert {k: logged[k] for k in shared} == {k: sdrl[k] for k in shared}
    # SD·RL adds its current K_max and the AR fallback under the same metric names
    assert {k.split("/", 2)[2] for k in sdrl if k.startswith("eval/diffusion_current/")} == \
        {k.split("/", 2)[2] for k in shared}
    assert sdrl["eval/diffusion_current/max_steps"] == 1 and "eval/ar/exact_match" in sdrl
    assert logged["eval/heldout_overlap"] == sdrl["eval/heldout_overlap"] == 0
