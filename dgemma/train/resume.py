"""What may start or resume where: the trainer's checks of `checkpoint.init_from` and of an existing checkpoint
directory (run before anything is written), and of what a restore brought back.

A checkpoint directory belongs to the run that wrote it: its checkpoints record `run_name`, `objective` and the
objective's `resume_settings` in their metadata (`dgemma.train.trainer`). Another `run.name` pointing
`checkpoint.dir` there is refused (to continue that run, use its `run.name`; to start from its weights, use
`checkpoint.init_from=<its run dir>/params`), and so is a resume under another objective or with a changed
resume setting (e.g. `sdrl.group_size`): each is one line naming the directory and the setting.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dgemma.config import RunConfig

__all__ = ["check_checkpoint_dir", "check_data_state", "check_init_from", "check_restored", "recorded_metadata"]

log = logging.getLogger(__name__)
METADATA_FILE = "_CHECKPOINT_METADATA"  # orbax's per-step metadata; its `custom_metadata` is what the trainer recorded
# resume settings recorded under an earlier name (checkpoints written before a rename): read as the current name,
# so a changed value is still refused
RENAMED_SETTINGS = {"sdrl.curriculum_budgets": "sdrl.curriculum_max_steps"}


def _config_error(msg: str) -> Exception:
    from dgemma.config.types import ConfigError

    return ConfigError(msg)


def check_init_from(init_from: str | None) -> None:
    """`checkpoint.init_from` must be a params checkpoint; checked before compiling and before the run dir exists."""
    if not init_from:
        return
    p = Path(init_from)
    if not p.is_dir():
        raise _config_error(f"checkpoint.init_from: {init_from} does not exist (or is not a directory)")
    if (p / "config.json").exists():
        raise _config_error(f"checkpoint.init_from: {init_from} is a Hugging Face checkpoint; convert it first "
                            f"(dgemma convert --hf {init_from} --out PARAMS) and set checkpoint.init_from=PARAMS")
    if not (p / "params").is_dir() and not any(c.is_dir() and c.name.isdigit() for c in p.iterdir()):
        raise _config_error(f"checkpoint.init_from: {init_from} holds no params checkpoint (no step directories)")


def _steps(ckpt_dir: Path) -> list[int]:
    if not ckpt_dir.is_dir():
        return []
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit() and p.is_dir())


def recorded_metadata(ckpt_dir: Path) -> tuple[int, dict] | None:
    """(step, recorded metadata) of the newest step in `ckpt_dir` whose metadata is readable; None if there is none.
    Read from the files, without opening a checkpoint manager (which would clean up another writer's temporaries)."""
    for step in reversed(_steps(Path(ckpt_dir))):
        try:
            md = json.loads((Path(ckpt_dir) / str(step) / METADATA_FILE).read_text()).get("custom_metadata")
        except (OSError, ValueError, AttributeError):
            continue
        return step, dict(md or {})
    return None


def check_checkpoint_dir(cfg: RunConfig, objective: Any, ckpt_dir: Path) -> None:
    """Refuse (one line) a checkpoint directory this run may not write to or resume from (module docstring)."""
    ckpt_dir = Path(ckpt_dir).absolute()
    found = recorded_metadata(ckpt_dir)
    if found is not None:
        step, md = found
        owner = md.get("run_name")
        if owner is not None and owner != cfg.run.name:
            raise _config_error(
                f"checkpoint.dir {ckpt_dir} holds checkpoints of run.name={owner} (step {step}), not of run.name="
                f"{cfg.run.name}; set run.name={owner} to continue that run, checkpoint.init_from=<its run dir>/params "
                f"to start from its weights, or choose another checkpoint.dir")
    steps = _steps(ckpt_dir)
    if steps and not cfg.checkpoint.resume:
        raise _config_error(f"checkpoint.resume=false but {ckpt_dir} already holds checkpoints {steps}; use another "
                            f"run.name / checkpoint.dir, or remove them")
    if found is None:
        return
    written = md.get("objective")
    if written is not None and written != objective.name:
        raise _config_error(
            f"cannot resume {ckpt_dir} (step {step}) under trainer.objective={objective.name}: it was written by "
            f"trainer.objective={written}; use another run.name (a new stage starts from the previous one's params "
            f"with checkpoint.init_from)")
    saved = {RENAMED_SETTINGS.get(name, name): value for name, value in (md.get("settings") or {}).items()}
    for name, value in objective.recorded_settings(cfg).items():
        if name in saved and saved[name] != value:
            raise _config_error(
                f"cannot resume {ckpt_dir} (step {step}) with {name}={value!r}: its checkpoints were written with "
                f"{name}={saved[name]!r}, which the saved state depends on; set it back or use another run.name")


def check_restored(state_step: int, step: int, updates_per_step: int, total: int, ckpt_dir: Path) -> None:
    """The restored state must be at the checkpoint's step, and `trainer.steps` must not be below it."""
    if state_step != step * updates_per_step:
        raise ValueError(f"checkpoint {step} in {ckpt_dir} holds a state after {state_step} optimizer updates, "
                         f"expected {step * updates_per_step}: the checkpoint is inconsistent")
    if step > total:
        raise _config_error(f"trainer.steps={total} is below the step {step} of the checkpoint in {ckpt_dir}; raise "
                            f"trainer.steps to continue, or use another run.name")


def check_data_state(it: Any, saved: dict | None, step: int) -> None:
    """The saved iterator state must describe the same stream at the same step as `iterator_from_step(step)`."""
    if not saved or not hasattr(it, "set_state"):
        log.warning("checkpoint step %d has no data-iterator state; positioning the data by the step alone", step)
        return
    if "step" in saved and int(saved["step"]) != step:
        raise ValueError(f"checkpoint step {step} holds a data-iterator state for step {saved['step']}: the "
                         "checkpoint is inconsistent")
    try:
        it.set_state(saved)
    except ValueError as e:
        raise ValueError(f"cannot resume the data stream at step {step}: {e}") from e
    if hasattr(it, "step") and int(it.step) != step:
        raise ValueError(f"data iterator is at {it.step} after restoring step {step}")
