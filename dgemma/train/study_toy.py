"""The toy study setup in seconds: the SD·RL study config shrunk to a tiny model and an untrained "stage-1" checkpoint.

    from dgemma.train.study_toy import write_toy_study
    config, stage1 = write_toy_study(tmp_dir, base=study_config)   # tmp_dir/tiny.yaml, tmp_dir/stage1/params
    config, stage1 = write_toy_study(tmp_dir, base=study_config,
                                     model={"num_hidden_layers": 1, "layer_types": ["full_attention"]})

A study's stage-2 config (`base`, e.g. the SD·RL study's `experiments/sdrl_study/stage2.yaml`; the caller names it,
since an installed package has no checkout beside it) shrunk to canvas 8, K_max 4 (teacher 8, curriculum
3 -> 2), one block after an 8-token prompt window, 3-5 digit COPY / SORT prompts (or the `tasks` given) and 5 trainer
steps, with the model's initial params (seed 0) saved as the stage-1 checkpoint. What runs on it checks plumbing (tables, CIs, held-out
disjointness, adapters), not a research hypothesis: the model is untrained. The SD·RL and LoRA study notebooks and the
study tests build on it (one definition instead of a copy in each).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["TOY_TASKS", "write_toy_study"]

TOY_TASKS = ({"name": "copy", "min_len": 3, "max_len": 5}, {"name": "sort", "min_len": 3, "max_len": 5})
_TOY = """\
base: [{base}]
model: {model}
data:
  tasks: {tasks}
  layout: {{prompt_len: 8, n_blocks: 1}}
sampler: {{max_steps: 4}}
sdrl: {{teacher_sampler: {{max_steps: 8}}, curriculum_max_steps: [3, 2], kl_estimator: k3, anchor_weight: 0.0}}
trainer: {{steps: 5}}
"""


def write_toy_study(directory: str | Path, *, base: str | Path, model: Mapping | None = None,
                    tasks: Sequence[Mapping] = TOY_TASKS) -> tuple[Path, Path]:
    """Write `directory`/tiny.yaml (the shrunk config over `base`; `model` adds model-section keys to canvas_length
    8; `tasks` are its data.tasks, e.g. 3-5 digit pick and fill over the many-answer regime's
    `experiments/sdrl_study/stage2_choice.yaml`, whose tokenizer has their symbols) and the untrained model's params
    (seed 0, step 0) to `directory`/stage1/params; return (config, params).

    Refuses (one line, nothing written) a missing `base` and a `directory` that already holds tiny.yaml or stage1/;
    if the checkpoint cannot be written, the config it wrote is removed again."""
    from flax import nnx

    from dgemma.checkpoint import save_params
    from dgemma.config import load_config
    from dgemma.model.transformer import Transformer

    directory, base = Path(directory), Path(base).resolve()
    config, params = directory / "tiny.yaml", directory / "stage1" / "params"
    if not base.is_file():
        raise FileNotFoundError(f"write_toy_study: base config {base} not found")
    for path in (config, directory / "stage1"):
        if path.exists():
            raise FileExistsError(f"write_toy_study: {path} exists; choose an empty directory")
    section = json.dumps({"canvas_length": 8, **dict(model or {})})  # JSON is a YAML flow mapping
    directory.mkdir(parents=True, exist_ok=True)
    config.write_text(_TOY.format(base=json.dumps(str(base)), model=section,
                                  tasks=json.dumps([dict(t) for t in tasks])))
    try:
        cfg = load_config(config)
        save_params(params, 0, nnx.state(Transformer(cfg.model_config, rngs=nnx.Rngs(0)), nnx.Param))
    except BaseException:
        config.unlink()
        if params.parent.is_dir() and not any(params.parent.iterdir()):  # save_params removed its own empty dir
            params.parent.rmdir()
        raise
    return config, params
