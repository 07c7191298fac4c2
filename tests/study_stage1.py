"""The toy SD·RL-study setup the study tests share: a tiny config over experiments/sdrl_study/stage2.yaml and an
untrained "stage-1" params checkpoint (plumbing only)."""

from pathlib import Path

from flax import nnx

REPO = Path(__file__).resolve().parents[1]


def tiny_study_dir(directory: Path, model: str = "canvas_length: 8") -> Path:
    """Write `directory`/tiny.yaml (`model` is the model section's body) and `directory`/stage1/params; return it."""
    from dgemma.checkpoint import save_params
    from dgemma.config import load_config
    from dgemma.model.transformer import Transformer

    (directory / "tiny.yaml").write_text(f"""
base: [{REPO}/experiments/sdrl_study/stage2.yaml]
model: {{{model}}}
data:
  tasks:
    - {{name: copy, min_len: 3, max_len: 5}}
    - {{name: sort, min_len: 3, max_len: 5}}
  canvas: {{prompt_len: 8, n_blocks: 1}}
sampler: {{max_steps: 4}}
sdrl: {{teacher_sampler: {{max_steps: 8}}, curriculum_max_steps: [3, 2], kl_estimator: k3, anchor_weight: 0.0}}
trainer: {{steps: 5}}
""")
    cfg = load_config(directory / "tiny.yaml")
    model_ = Transformer(cfg.model_config, rngs=nnx.Rngs(0))
    save_params(directory / "stage1" / "params", 0, nnx.state(model_, nnx.Param))
    return directory
