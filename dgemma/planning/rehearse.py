"""The full-shape CPU rehearsal of a shipped run config: only the widths shrink.

    plan = rehearsal_plan("configs/stage1/gemma4_26b_a4b.yaml", devices=8, quick=True)
    write_configs(plan, out)   # <out>/configs/stage1.yaml (and stage2.yaml): `base:` the shipped file + overlays

`shrunk_overlay` changes the hidden size, the dense and expert MLP widths, the head dims and the vocabulary (to
`WIDTHS`) and nothing else of the model: depth, the sliding/full pattern, experts and top-k, canvas length, window,
RoPE and every execution setting (remat, layer scan, attention and MoE implementation) stay as shipped, and so do the
mesh axes and rules, the optimizer and the SD·RL section (teacher, reference, curriculum). What a CPU cannot run is
replaced by its CPU equivalent and said so (`cpu_equivalents`). The data section becomes the synthetic task mix with
the toy tokenizer (no dataset or tokenizer files on a CPU box), at the shipped training layout (`--quick`: one prompt
window of 512 tokens and one canvas; the batch is one row per simulated device).

The phases themselves (`dgemma.planning.rehearse_phases`) run the CLI entry points as child processes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from dgemma.config import load_config, resolve_config_path
from dgemma.config.yaml_io import dump_yaml, read_tree
from dgemma.parallel.mesh import fixed_device_count
from dgemma.train.objectives import get_objective

__all__ = ["WIDTHS", "Rehearsal", "cpu_equivalents", "execution_settings", "rehearsal_plan", "shrunk_overlay",
           "write_configs"]

WIDTHS: dict[str, int] = {
    "hidden_size": 32, "intermediate_size": 32, "moe_intermediate_size": 16, "head_dim": 8, "global_head_dim": 16,
    "vocab_size": 128,  # >= the toy tokenizer's and holds the shipped special ids (eos 1, 106, 50; bos 2; pad 0)
}
"""The model fields the rehearsal shrinks (every one a width; nothing else of the model changes)."""

EXECUTION_KEY = "model.execution"
"""Where the execution settings live in a config (dotted override prefix)."""

QUICK_LAYOUT = {"prompt_len": 512, "n_blocks": 1}  # one 512-token window + one canvas: a multiple of the chunk
QUICK_SDRL = {"group_size": 2, "num_minibatches": 1, "inner_epochs": 1, "states_per_rollout": 1}
QUICK_STEP_DIVISOR = 6
"""--quick divides the denoising-step limits (student max_steps, the teacher's, the curriculum's) by this: the
26B-shaped SD·RL iteration planned 1.9e13 FLOPs as shipped (G 2, M 4, 2 epochs), ~2 hours on the shared 2-core VM."""


def execution_settings(model: Any) -> dict[str, Any]:
    """The execution settings of a resolved `ModelConfig` (the one place that reads them)."""
    ex = model.execution
    return {f.name: getattr(ex, f.name) for f in dataclasses.fields(ex)}


def cpu_equivalents(settings: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    """{field: (CPU value, why)} for the execution settings a CPU cannot run as shipped; the rest run as shipped.
    The experts' grouped matmul (`moe_kernel` auto / megablox / tokamax: sparse on the accelerator) runs as
    "gathered", plain JAX with each routed row's expert matrix gathered: also sparse. On CPU `auto` would be XLA's
    `ragged_dot`, which XLA:CPU expands densely over every expert (rows x E x width per call: the 128-expert stage-1
    step compiled to 1.75 GiB of temporaries per simulated device at 6 layers, 14 GiB for 8, and was OOM-killed)."""
    out: dict[str, tuple[Any, str]] = {}
    if settings["attention_impl"] in ("splash", "tokamax"):
        out["attention_impl"] = ("chunked", f"{settings['attention_impl']} is a TPU/GPU kernel")
    if settings["moe_kernel"] in ("auto", "megablox", "tokamax"):
        why = "a TPU/GPU kernel" if settings["moe_kernel"] != "auto" else "XLA's ragged_dot on cpu"
        out["moe_kernel"] = ("gathered", f"{settings['moe_kernel']} is {why}, which XLA:CPU expands densely over "
                                         f"the experts; the gathered stand-in is sparse like the accelerator kernels")
    if settings["remat"] == "offload":
        out["remat"] = ("save_dots", "offload needs a device with its own memory")
    return out


@dataclasses.dataclass(frozen=True)
class Rehearsal:
    """What a rehearsal runs: the shipped stage-1 config, the stage-2 config (or None) and their overlays."""

    stage1: Path
    stage2: Path | None
    devices: int
    quick: bool
    overlays: dict[str, dict[str, Any]]  # "stage1" / "stage2" -> the YAML overlay on top of the shipped file
    summary: str  # one line: the shape kept and the CPU equivalents


def _has_model_section(path: Path) -> bool:
    return isinstance(read_tree(path).get("model"), dict)


def _stage2_for(stage1: Path) -> Path | None:
    """The stage-2 twin of a shipped stage-1 config (configs/stage1/X.yaml -> configs/stage2/X.yaml)."""
    if stage1.parent.name != "stage1":
        return None
    twin = stage1.parent.parent / "stage2" / stage1.name
    return twin if twin.is_file() else None


def shrunk_overlay(path: Path, *, devices: int, quick: bool, stage: str) -> dict[str, Any]:
    """The YAML overlay (merged on top of the shipped `path`) of a rehearsal run of `stage` ("stage1" | "stage2")."""
    cfg = load_config(path, env={})
    settings = execution_settings(cfg.model_config)
    model: dict[str, Any] = dict(WIDTHS)
    cpu = {k: v for k, (v, _) in cpu_equivalents(settings).items()}
    if cpu:
        model["execution"] = cpu
    layout = dict(QUICK_LAYOUT) if quick else {"prompt_len": cfg.data.layout.prompt_len,
                                               "n_blocks": cfg.data.layout.n_blocks}
    data: dict[str, Any] = {"source": "synthetic", "paths": [], "eval_paths": [], "layout": layout,
                            "tokenizer": {"kind": "toy", "path": None, "chat": False},  # no chat template on the toy
                            "batch_size": devices, "tasks": [{"name": "copy", "weight": 1.0},
                                                             {"name": "sort", "weight": 1.0}]}
    overlay: dict[str, Any] = {
        "model": model, "data": data, "logging": {"wandb": False, "jsonl": True},
        "trainer": {"log_every": 1, "eval_every": 0},  # grad_accum_steps as shipped (0 = derived; SD·RL: 1)
        # the schedule's shape is kept; its warmup cannot exceed the rehearsal's few updates
        "optim": {"warmup_steps": min(cfg.optim.warmup_steps, 1)},
        "checkpoint": {"every": 1, "every_seconds": 0, "async_save": cfg.checkpoint.async_save},
    }
    if stage == "stage2" and quick:  # smaller sizes and step limits (said so in the plan line); the algorithm,
        # teacher, reference, curriculum schedule and sampler rule as shipped
        def fewer(k: int) -> int:
            return max(1, -(-k // QUICK_STEP_DIVISOR))

        overlay["sdrl"] = {**QUICK_SDRL, "curriculum_max_steps": [fewer(k) for k in cfg.sdrl.curriculum_max_steps],
                           "teacher_sampler": {"max_steps": fewer(cfg.sdrl.teacher_sampler.max_steps)}}
        overlay["sampler"] = {"max_steps": fewer(cfg.sampler.max_steps)}
    return overlay


def _describe(path: Path, devices: int, quick: bool) -> str:
    cfg = load_config(path, env={})
    m = cfg.model_config
    s = execution_settings(m)
    full = sum(t == "full_attention" for t in m.layer_types)
    cpu = cpu_equivalents(s)
    kept = (f"{m.num_hidden_layers} layers ({m.num_hidden_layers - full} sliding : {full} full), "
            f"{m.num_experts} experts top-{m.top_k_experts}, canvas {m.canvas_length}, window {m.sliding_window}, "
            f"remat {s['remat']}, scan_layers {s['scan_layers']}, attention {s['attention_impl']}, "
            f"moe {s['moe_impl']}/{s['moe_kernel']}, mesh {dict(cfg.mesh.ici)} rules {cfg.mesh.rules} "
            f"on {devices} cpu devices, "
            f"optim {cfg.optim.name} lr {cfg.optim.lr}")
    swapped = "; ".join(f"{k} {s[k]} -> {v} on cpu ({why})" for k, (v, why) in cpu.items())
    widths = ", ".join(f"{k} {getattr(m, k)}->{v}" for k, v in WIDTHS.items())
    return f"kept: {kept}; widths: {widths}" + (f"; cpu equivalents: {swapped}" if swapped else "") + (
        f"; --quick: training layout 512 + 1 x 256, SD·RL {QUICK_SDRL} and denoising-step limits "
        f"(student, teacher, curriculum) / {QUICK_STEP_DIVISOR}" if quick else "")


def rehearsal_plan(config: str | Path, *, devices: int = 8, quick: bool = False) -> Rehearsal:
    """Check `config` and build the overlays. Raises ValueError (one line) for a missing file or a config without a
    model section, and the config loader's error for an invalid one."""
    path = resolve_config_path(config)
    if not path.is_file():
        raise ValueError(f"config {config}: no such file")
    if not _has_model_section(path):
        raise ValueError(f"config {config}: has no model section (neither it nor its base: chain sets model:); the "
                         f"rehearsal shrinks a shipped model config")
    if devices < 1:
        raise ValueError(f"--devices {devices}: must be >= 1")
    cfg = load_config(path, env={})
    fixed = fixed_device_count(cfg.mesh)
    if fixed is not None and fixed != devices:  # else every phase fails late on the planner's refusal
        raise ValueError(f"--devices {devices}: the config's mesh is fixed at {fixed} device(s) "
                         f"(mesh.ici {dict(cfg.mesh.ici)}); pass --devices {fixed}")
    stage1, stage2 = path.resolve(), None
    if get_objective(cfg.trainer.objective).rollouts:  # given the stage-2 config: find its stage-1 twin
        stage2 = stage1
        twin = stage1.parent.parent / "stage1" / stage1.name
        stage1 = twin if twin.is_file() else stage1
    else:
        stage2 = _stage2_for(stage1)
    overlays = {"stage1": shrunk_overlay(stage1, devices=devices, quick=quick, stage="stage1")}
    if stage2 is not None:
        overlays["stage2"] = shrunk_overlay(stage2, devices=devices, quick=quick, stage="stage2")
    return Rehearsal(stage1, stage2, devices, quick, overlays, _describe(stage1, devices, quick))


def write_configs(plan: Rehearsal, out: Path) -> dict[str, Path]:
    """Write `<out>/configs/<stage>.yaml` (`base:` the shipped file, then the overlay); returns {stage: path}."""
    d = out / "configs"
    d.mkdir(parents=True, exist_ok=True)
    paths = {}
    for stage, overlay in plan.overlays.items():
        shipped = plan.stage1 if stage == "stage1" else plan.stage2
        p = d / f"{stage}.yaml"
        p.write_text(f"# rehearsal of {shipped}: only the widths shrink (dgemma rehearse)\n"
                     + dump_yaml({"base": [str(shipped)], **overlay}))
        paths[stage] = p
    return paths
