"""`dgemma rehearse`: the full-shape rehearsal of a shipped run on CPU, only the widths shrunk.

    dgemma rehearse configs/stage1/gemma4_26b_a4b.yaml --quick             # measured times: docs/rehearsal.md
    dgemma rehearse configs/stage1/gemma4_26b_a4b.yaml --devices 8 --out /tmp/rehearsal

Everything but the widths stays as shipped (`dgemma.planning.rehearse`): depth and the sliding/full pattern, experts
and top-k, canvas length, the training layout (`--quick`: 512 + 1 x 256 tokens), remat, layer scan, attention and MoE
implementation (a TPU/GPU-only kernel runs as its CPU equivalent, printed; the experts' grouped matmul as the sparse
`moe_kernel=gathered`, since XLA:CPU's ragged_dot is dense over every expert), the mesh axes and sharding rules on
`--devices` simulated CPU devices, the optimizer, and the stage-2 (configs/stage2/<same name>) SD·RL settings. The
phases (`dgemma.planning.rehearse_phases`) run the commands a user runs, as child processes: 2 stage-1 steps through
`dgemma launch --target local`; a SIGKILL after the step-1 checkpoint and a resume whose params equal the straight
run's bit for bit; 1 SD·RL iteration from that checkpoint; `dgemma sample` and `dgemma eval` on it; `dgemma export`
in bfloat16 and FP8 (automatic block), each reloaded in transformers with dgemma's logits.

Phases run as soon as what they need has passed, two at a time (sample, eval and the two exports, which read only
the SD·RL params, beside each other). One line per phase as it ends (name, PASS/FAIL/SKIP, seconds, its own CPU and compile
seconds, key figure), then a summary line. Everything is written under `--out` (default: a new temporary directory);
an existing non-empty `--out` is refused. Exit codes: 0 every phase passed, 1 a phase failed, 2 bad input (nothing
written), 143 stopped by SIGTERM (`kill`, `timeout`; every child process is killed on the way out).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from dgemma.cli import common

NAME = "rehearse"
HELP = "rehearse a shipped run on CPU at full depth / experts / layout with tiny widths (train, kill+resume, SD·RL, sample, eval, export)"


def _emit_flushed(line: str) -> None:
    print(line, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    parser.add_argument("--quick", action="store_true",
                        help="shorter training layout (512 + 1 x 256 tokens), smaller SD·RL sizes (G, M, epochs, "
                             "minibatches, denoising steps / 6); same depth, experts and layout")
    parser.add_argument("--out", metavar="DIR", help="output directory (default: a new temporary directory)")
    # Test-only knobs (hidden): a default-suite test runs a reduced rehearsal. Not for users: they change the shape.
    parser.add_argument("--test-only-layers", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--test-only-phases", default=None, help=argparse.SUPPRESS)


def _fail(msg: str) -> int:
    print(f"dgemma rehearse: {msg}", file=sys.stderr)
    return common.EXIT_USAGE


def run(args: argparse.Namespace) -> int:
    from dgemma.planning.rehearse import rehearsal_plan, write_configs
    from dgemma.planning.rehearse_phases import PHASES, exit_on_sigterm, run_phases

    rest = list(args.overrides or [])
    if args.config is None and rest and "=" not in rest[0]:
        args.config = rest.pop(0)
    if args.config is None:
        return _fail("give a config, e.g. dgemma rehearse configs/stage1/gemma4_26b_a4b.yaml --quick")
    if rest:
        from dgemma.config import load_config

        load_config(args.config, rest)  # a misspelt key is the loader's usual error (exit 2, with a suggestion)
        return _fail(f"overrides {rest}: the rehearsal runs the config as shipped (only the widths shrink); "
                     "edit a copy of the config instead")
    phases = PHASES
    if args.test_only_phases:
        phases = tuple(p for p in args.test_only_phases.split(","))
        unknown = [p for p in phases if p not in PHASES]
        if unknown:
            return _fail(f"--test-only-phases: unknown {unknown}; phases are {list(PHASES)}")
    out = Path(args.out) if args.out else None
    if out is not None and out.exists() and (not out.is_dir() or any(out.iterdir())):
        return _fail(f"--out {out}: exists and is not an empty directory; give a new or empty one")
    try:
        plan = rehearsal_plan(args.config, devices=args.devices, quick=args.quick)
    except ValueError as e:
        return _fail(str(e).splitlines()[0])
    if args.test_only_layers is not None:
        for overlay in plan.overlays.values():
            overlay["model"]["num_hidden_layers"] = args.test_only_layers
    created = out is None
    out = Path(tempfile.mkdtemp(prefix="dgemma_rehearse_")) if out is None else out
    out.mkdir(parents=True, exist_ok=True)
    configs = write_configs(plan, out)
    repo = Path(__file__).resolve().parents[2]
    print(f"rehearse {plan.stage1}" + (f" + {plan.stage2}" if plan.stage2 else "") + f" -> {out}"
          + (" (new temporary directory)" if created else ""))
    print(plan.summary + (f"; TEST ONLY: {args.test_only_layers} layers" if args.test_only_layers else ""))
    sys.stdout.flush()
    t0 = time.time()
    exit_on_sigterm()  # `kill` / `timeout`: through run_phases' cleanup, which stops every child process
    results = run_phases(out, configs, args.devices, repo, emit=_emit_flushed, phases=phases)
    passed = sum(r.passed is True for r in results)
    failed = [r.name for r in results if r.passed is not True]
    verdict = "PASS" if not failed else "FAIL"
    print(f"rehearse     {verdict}  {time.time() - t0:7.1f} s  {passed}/{len(results)} phases passed"
          + (f"; failed or skipped: {', '.join(failed)}" if failed else "") + f"; output in {out}")
    return common.EXIT_OK if not failed else common.EXIT_ERROR


if __name__ == "__main__":
    sys.exit(common.standalone(sys.modules[__name__]))
