"""`dgemma rehearse`: the rehearsal configs keep the shipped 26B run as shipped except the widths; bad input is one
line with nothing written; one phase end to end (reduced, default suite); the whole `--quick` rehearsal (slow)."""

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support.block_layout import max_rel
from support.cli_errors import one_line_error
from dgemma.cli.main import main
from dgemma.config import load_config
from dgemma.planning.rehearse import WIDTHS, execution_settings, rehearsal_plan, write_configs

REPO = Path(__file__).resolve().parents[2]
STAGE1 = REPO / "configs/stage1/gemma4_26b_a4b.yaml"
STAGE2 = REPO / "configs/stage2/gemma4_26b_a4b.yaml"
TINY = REPO / "configs/stage1/tiny.yaml"  # its stage-2 twin: configs/stage2/tiny.yaml


def _load(path):
    return load_config(path, env={})


@pytest.mark.parametrize("quick", [False, True])
def test_only_the_widths_shrink(tmp_path, quick):
    plan = rehearsal_plan(STAGE1, devices=8, quick=quick)
    assert plan.stage1 == STAGE1 and plan.stage2 == STAGE2
    paths = write_configs(plan, tmp_path)
    for stage, shipped_path in (("stage1", STAGE1), ("stage2", STAGE2)):
        shipped, ours = _load(shipped_path), _load(paths[stage])
        m0, m1 = shipped.model_config, ours.model_config
        for name, value in WIDTHS.items():
            assert getattr(m1, name) == value < getattr(m0, name), name
        kept = {f.name for f in dataclasses.fields(m0)} - set(WIDTHS) - {"execution"}
        assert {n: getattr(m1, n) for n in kept} == {n: getattr(m0, n) for n in kept}
        assert m1.num_hidden_layers == 30 and m1.layer_types.count("full_attention") == 5
        assert (m1.num_experts, m1.top_k_experts, m1.canvas_length) == (128, 8, 256)
        # the execution settings as shipped, but the experts' grouped matmul: its sparse CPU stand-in, said so
        assert execution_settings(m0)["moe_kernel"] == "auto" and execution_settings(m1)["moe_kernel"] == "gathered"
        assert {**execution_settings(m1), "moe_kernel": "auto"} == execution_settings(m0)
        assert "moe_kernel auto -> gathered on cpu" in plan.summary
        assert execution_settings(m1)["scan_layers"] and execution_settings(m1)["remat"] in ("save_dots", "full")
        assert ours.mesh == shipped.mesh
        assert dataclasses.replace(ours.optim, warmup_steps=shipped.optim.warmup_steps) == shipped.optim
        if quick:
            assert (ours.data.layout.prompt_len, ours.data.layout.n_blocks) == (512, 1)
        else:
            assert ours.data.layout == dataclasses.replace(shipped.data.layout, tail_fill=ours.data.layout.tail_fill)
        if stage == "stage2" and not quick:
            assert ours.sampler == shipped.sampler
            assert ours.sdrl == shipped.sdrl  # teacher, reference, curriculum as shipped
        if stage == "stage2" and quick:  # smaller budgets; the rest of the sampler and SD·RL sections as shipped
            assert (ours.sampler.max_steps, ours.sdrl.teacher_sampler.max_steps) == (8, 16)
            assert ours.sdrl.curriculum_max_steps == (6, 4, 3, 2) and ours.trainer.grad_accum_steps == 1
            assert ours.sampler == dataclasses.replace(shipped.sampler, max_steps=8)
            budgets = dict(group_size=2, num_minibatches=1, inner_epochs=1, states_per_rollout=1,
                           curriculum_max_steps=(6, 4, 3, 2),
                           teacher_sampler=dataclasses.replace(shipped.sdrl.teacher_sampler, max_steps=16))
            assert ours.sdrl == dataclasses.replace(shipped.sdrl, **budgets)


def test_stage2_config_finds_its_stage1_twin():
    plan = rehearsal_plan(STAGE2, devices=8, quick=True)
    assert plan.stage1 == STAGE1 and plan.stage2 == STAGE2


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["rehearse", str(tmp_path / "missing.yaml"), "--out", str(out)]) == 2
    one_line_error(capsys, "missing.yaml", "no such file")
    no_model = tmp_path / "no_model.yaml"
    no_model.write_text("run: {name: x}\n")
    assert main(["rehearse", str(no_model), "--out", str(out)]) == 2
    one_line_error(capsys, "no_model.yaml", "no model section")
    assert not out.exists()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    assert main(["rehearse", str(STAGE1), "--out", str(busy)]) == 2
    one_line_error(capsys, "--out", "not an empty directory")
    assert [p.name for p in busy.iterdir()] == ["keep.txt"] and (busy / "keep.txt").read_text() == "mine"
    assert main(["rehearse", str(TINY), "--out", str(out)]) == 2  # its mesh is fixed at 1 device; the default is 8
    one_line_error(capsys, "--devices 8", "fixed at 1 device(s)", "pass --devices 1")
    assert not out.exists()


def test_params_equal_check_is_bit_exact(tmp_path):
    """The kill/resume verdict: equal params pass; one float32 ulp in one leaf fails, naming the leaf."""
    from dgemma.checkpoint.params import save_params
    from dgemma.planning.rehearse_check import params_equal

    w = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    save_params(tmp_path / "a", 2, {"layer": {"w": w, "b": np.ones(4, np.float32)}})
    save_params(tmp_path / "b", 2, {"layer": {"w": w.copy(), "b": np.ones(4, np.float32)}})
    assert "2 leaves, 16 params bit-identical" in params_equal(str(tmp_path / "a"), str(tmp_path / "b"))
    w2 = w.copy()
    w2[1, 2] = np.nextafter(w2[1, 2], np.float32(2))
    save_params(tmp_path / "c", 2, {"layer": {"w": w2, "b": np.ones(4, np.float32)}})
    with pytest.raises(AssertionError, match=r"1 of 2 leaves differ.*'w'"):
        params_equal(str(tmp_path / "a"), str(tmp_path / "c"))


def test_export_logits_check(tmp_path):
    """The export phases' verdict on a tiny random DiffusionGemma: bf16 and FP8 exports reload in transformers with
    dgemma's logits; an export missing one text weight is refused."""
    pytest.importorskip("transformers")
    from support import hf_reference as R
    from safetensors.numpy import load_file, save_file

    from dgemma.convert.hf_export import export_hf
    from dgemma.convert.hf_import import load_hf_checkpoint
    from dgemma.planning.rehearse_check import export_logits

    R.diffusion_gemma("a", seed=5).save_pretrained(tmp_path / "src")
    model, _ = load_hf_checkpoint(tmp_path / "src")
    bf16 = export_hf(model, tmp_path / "bf16")
    fp8 = export_hf(model, tmp_path / "fp8", quantization="fp8", fp8_block_size=(32, 32))
    assert export_logits(str(bf16), str(tmp_path)).startswith("bf16: max |dlogit|")
    assert export_logits(str(fp8), str(tmp_path)).startswith("dequantised fp8: max |dlogit|")
    tensors = load_file(str(bf16 / "model.safetensors"))
    del tensors["model.decoder.layers.0.self_attn.q_proj.weight"]
    save_file(tensors, str(bf16 / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(AssertionError, match="missing .*q_proj"):
        export_logits(str(bf16), str(tmp_path))


def test_forced_routes_accept_ties_only():
    """The export check's routing (`_forced_routes`): transformers' router takes dgemma's expert ids; its own ids pass
    with no tie, a tie at the k-th place may be broken either way (counted), and ids that are not a tie are refused:
    fixing the routes never hides a router that maps wrongly."""
    pytest.importorskip("transformers")
    from support import hf_reference as R
    import torch

    from dgemma.planning.rehearse_check import _forced_routes

    model = R.diffusion_gemma("a", seed=5)
    router = next(m for m in model.modules() if type(m).__name__.endswith("TextRouter"))
    cls = type(router)
    hidden = torch.randn(6, router.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        probs, weights, own = router(hidden)
        # a tie: expert e's router column copied from the k-th choice of token 0, then forced to take e instead
        kth, e = int(own[0, -1]), next(i for i in range(probs.shape[-1]) if i not in own[0].tolist())
        report = {}
        with _forced_routes(cls, [own.numpy()], report):
            _, w, idx = router(hidden)
        assert torch.equal(idx, own) and torch.allclose(w, weights) and report == {"routed": 6, "ties": 0}
        router.proj.weight[e] = router.proj.weight[kth]
        probs, _, own = router(hidden)
        tie = own.clone()
        tie[0, (own[0] == kth).nonzero()[0, 0]] = e
        report = {}
        with _forced_routes(cls, [tie.numpy()], report):
            _, _, idx = router(hidden)
        assert torch.equal(idx, tie) and report["ties"] >= 1
        wrong = own.clone()
        outside = [i for i in range(probs.shape[-1]) if i not in own[1].tolist()]
        worst = min(outside, key=lambda i: float(probs[1, i]))
        assert probs[1, worst] < probs[1, own[1]].min() * (1 - 1e-3)  # a real difference, not a tie
        wrong[1, 0] = worst
        with pytest.raises(AssertionError, match="by more than a tie"), _forced_routes(cls, [wrong.numpy()], {}):
            router(hidden)
        with pytest.raises(AssertionError, match="more router calls than dgemma"), _forced_routes(cls, [], {}):
            router(hidden)


def test_phase_accounting_counts_compiles_and_killed_cpu(tmp_path):
    """The phase lines' figures: JAX's compile log of a real child (a compile, then a persistent-cache hit in a
    second process) is summed and counted; a process group's CPU seconds include a live grandchild, which
    RUSAGE_CHILDREN would miss once the group is SIGKILLed."""
    import os
    import signal

    from dgemma.planning.rehearse_phases import PhaseResult, Runner, _group_cpu_seconds

    runner = Runner(tmp_path, {}, 1, REPO)
    child = [sys.executable, "-c", "import jax, jax.numpy as jnp; jax.jit(lambda x: jnp.sin(x) @ x)(jnp.ones(64))"]
    runner.env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    sizes = runner.log_sizes()
    runner._cmd("first", child)
    seconds, hits = runner.compiles_since(sizes)
    assert seconds > 0 and hits == 0
    sizes = runner.log_sizes()
    runner._cmd("second", child)
    assert runner.compiles_since(sizes)[1] >= 1  # the lambda (and the eager ops) loaded from out/jax_cache
    assert runner.compiles_since(runner.log_sizes()) == (0.0, 0)  # nothing new since
    line = PhaseResult("stage1", True, 3.0, "x", cpu_seconds=2.5, compile_seconds=1.25, cache_hits=4).line()
    assert "cpu     2.5 s" in line and "compile    1.2 s (4 cached)" in line and " PASS " in line

    burn = ("import subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import time\\nwhile time.process_time() < 1.2: pass\\n"
            "open(\\'%s\\', \\'w\\').close()\\ntime.sleep(60)'])\n"
            "time.sleep(60)\n" % (tmp_path / "burnt"))
    p = subprocess.Popen([sys.executable, "-c", burn], start_new_session=True)
    try:
        for _ in range(600):  # the grandchild has spent 1.2 CPU seconds (no wall-clock bound on a loaded machine)
            if (tmp_path / "burnt").exists() or p.poll() is not None:
                break
            subprocess.run(["sleep", "0.5"], check=True)
        assert (tmp_path / "burnt").exists()
        assert _group_cpu_seconds(p.pid) >= 1.0  # 1.2 s burnt; /proc counts whole clock ticks (1.0 read as 0.99)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _burner_runner(fail: str | None = None):
    """Runner whose phases each run one real child burning ~0.4 CPU s (and record when they ran)."""
    from dgemma.planning import rehearse_phases as rp

    class Burner(rp.Runner):
        spans: dict[str, tuple[float, float]] = {}

        def __getattribute__(self, name):
            if name not in rp.PHASES:
                return super().__getattribute__(name)

            def phase():
                t0 = time.time()
                if name == fail:
                    raise rp.PhaseError(f"{name} broke")
                self._cmd(name, [sys.executable, "-c", "import time\nwhile time.process_time() < 0.4: pass"])
                Burner.spans[name] = (t0, time.time())
                return f"{name} ran"
            return phase
    return Burner


@pytest.mark.parametrize("jobs", [1, 2])
def test_phases_run_side_by_side_with_their_own_accounting(tmp_path, monkeypatch, jobs):
    """The scheduler: with 2 jobs the four phases that read the SD·RL params overlap (never one before what it
    needs); each phase's CPU seconds are its own child's, not its neighbour's; results come back in phase order."""
    from dgemma.planning import rehearse_phases as rp

    burner = _burner_runner()
    monkeypatch.setattr(rp, "Runner", burner)
    lines = []
    res = rp.run_phases(tmp_path, {}, 1, REPO, emit=lines.append, jobs=jobs)
    assert [r.name for r in res] == list(rp.PHASES) and all(r.passed for r in res) and len(lines) == 7
    span = burner.spans
    for name, needs in rp.NEEDS.items():
        assert all(span[n][1] <= span[name][0] for n in needs), (name, span)
    overlap = span["eval"][0] < span["sample"][1] and span["sample"][0] < span["eval"][1]
    assert overlap == (jobs == 2), span
    for r in res:
        assert 0.35 <= r.cpu_seconds < 0.75, r  # one burner (+ interpreter start), never two


def test_a_failed_phase_skips_what_needs_it(tmp_path, monkeypatch):
    from dgemma.planning import rehearse_phases as rp

    monkeypatch.setattr(rp, "Runner", _burner_runner(fail="sdrl"))
    res = {r.name: r for r in rp.run_phases(tmp_path, {}, 1, REPO, emit=lambda _: None)}
    assert res["sdrl"].passed is False and res["sdrl"].figure == "sdrl broke"
    assert all(res[n].passed is None and "needs sdrl" in res[n].figure
               for n in ("sample", "eval", "export_bf16", "export_fp8"))
    assert res["stage1"].passed and res["kill_resume"].passed


SLEEPERS = """
import os, sys, time
from pathlib import Path
from dgemma.planning import rehearse_phases as rp

out = Path(sys.argv[1])

class Sleepers(rp.Runner):  # every phase starts a launch-like tree: a child whose own child sleeps, pids recorded
    def __getattribute__(self, name):
        if name not in rp.PHASES:
            return super().__getattribute__(name)
        if name in rp.NEEDS["sample"] + ("stage1", "kill_resume"):  # quick up to the four that run two at a time
            return lambda: self._cmd(name, [sys.executable, "-c", "pass"])
        tree = ("import os, subprocess, sys, time\\n"
                "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\\n"
                f"open({str(out)!r} + f'/pids/{name}', 'w').write(f'{{os.getpid()}} {{c.pid}}')\\n"
                "time.sleep(300)")
        return lambda: self._cmd(name, [sys.executable, "-c", tree])

rp.Runner = Sleepers
rp.exit_on_sigterm()
rp.run_phases(out, {}, 1, Path.cwd(), jobs=2)
"""


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "gone"


def test_sigterm_stops_every_child_process(tmp_path):
    """`timeout` / `kill` on `dgemma rehearse` (SIGTERM): the children the running phases started (each a process
    group of its own, two deep like `dgemma launch`) are killed, none left running unowned; exit 143."""
    import os
    import signal

    (tmp_path / "pids").mkdir()
    p = subprocess.Popen([sys.executable, "-c", SLEEPERS, str(tmp_path)], cwd=REPO)
    try:
        for _ in range(600):
            if len(list((tmp_path / "pids").iterdir())) == 2 or p.poll() is not None:
                break
            time.sleep(0.1)
        pids = [int(x) for f in (tmp_path / "pids").iterdir() for x in f.read_text().split()]
        assert len(pids) == 4 and all(_state(x) not in ("gone", "Z") for x in pids)  # sample and eval, 2 deep
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 128 + signal.SIGTERM
        for _ in range(100):
            if all(_state(x) in ("gone", "Z") for x in pids):
                break
            time.sleep(0.1)
        assert all(_state(x) in ("gone", "Z") for x in pids), {x: _state(x) for x in pids}
    finally:
        if p.poll() is None:
            p.kill()
        for x in locals().get("pids", []):
            if _state(x) not in ("gone", "Z"):
                os.kill(x, signal.SIGKILL)


def test_sample_shows_ids_beyond_the_tokenizer():
    """The rehearsal's vocabulary (128) is larger than the toy tokenizer's: `dgemma sample` of its untrained model
    prints such an id as <id N> (it failed the sample phase with the tokenizer's ValueError)."""
    from dgemma.cli.sample import decode_shown
    from dgemma.data.tokenizer import ToyTokenizer

    tok = ToyTokenizer()
    ids = list(tok.encode("C12|"))
    assert decode_shown(tok, ids) == tok.decode(ids)
    assert decode_shown(tok, ids[:2] + [WIDTHS["vocab_size"] - 1] + ids[2:]) == (
        tok.decode(ids[:2]) + f"<id {WIDTHS['vocab_size'] - 1}>" + tok.decode(ids[2:]))


def _routed(M, G, rng):
    """Group sizes of M - 37 routed rows over G groups (group 5 empty); the last 37 rows are unrouted."""
    sizes = np.bincount(rng.integers(0, G, M - 37), minlength=G).astype(np.int32)
    sizes[5] = 0
    return jnp.asarray(sizes)


def test_gathered_stand_in_equals_ragged_dot():
    """The rehearsal's CPU grouped matmul: ragged_dot's values and gradients (fp32 summation order apart); unrouted
    rows give exactly 0 and get no gradient."""
    from dgemma.model.kernels import gathered_matmul

    rng = np.random.default_rng(0)
    M, K, N, G = 300, 32, 16, 12
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((G, K, N)), jnp.float32)
    sizes = _routed(M, G, rng)
    out, ref = gathered_matmul(x, w, sizes), jax.lax.ragged_dot(x, w, sizes)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(ref).max()) > 1.0 and not np.asarray(out)[M - 37:].any()

    def loss(matmul):
        return lambda a, b: jnp.sum(jnp.sin(matmul(a, b, sizes)))

    g_out = jax.grad(loss(gathered_matmul), (0, 1))(x, w)
    g_ref = jax.grad(loss(jax.lax.ragged_dot), (0, 1))(x, w)
    for a, b in zip(g_out, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert not np.asarray(g_out[0])[M - 37:].any() and not np.asarray(g_out[1])[5].any()


def test_moe_block_with_the_stand_in_equals_xla():
    from flax import nnx

    from dgemma.model.config import tiny
    from dgemma.model.moe import MoEBlock

    cfg = tiny()
    ref = MoEBlock(cfg, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    ours = MoEBlock(cfg.with_execution(moe_kernel="gathered"), param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 24, cfg.hidden_size)), jnp.float32)
    out, want = ours(x), ref(x)  # the setting reaches the experts (gradients: the matmul's test above)
    assert max_rel(out, want) <= 1e-5 and float(jnp.abs(want).max()) > 1e-3


def test_stand_in_memory_at_the_rehearsal_shape():
    """What OOM-killed the 26B-shaped rehearsal, at its shape per simulated device (the --quick layout's MoE rows:
    (512 + 2 x 256 + 256 self-conditioning) tokens x top-8, the shipped 128 experts, the rehearsal's widths): XLA:CPU's
    ragged_dot needs rows x experts x width of temporaries for one matmul's value and gradients; the stand-in needs
    rows x width x width, at least 4x less, and under 64 MB."""
    from dgemma.model.kernels import gathered_matmul

    M, G, K, N = 1280 * 8, 128, WIDTHS["hidden_size"], WIDTHS["moe_intermediate_size"]
    x, w = jax.ShapeDtypeStruct((M, K), jnp.float32), jax.ShapeDtypeStruct((G, K, N), jnp.float32)
    sizes = jnp.full((G,), M // G, jnp.int32)

    def temp_bytes(matmul):
        step = jax.jit(jax.value_and_grad(lambda a, b: jnp.sum(jnp.sin(matmul(a, b, sizes))), (0, 1)))
        return step.lower(x, w).compile().memory_analysis().temp_size_in_bytes

    dense, ours = temp_bytes(jax.lax.ragged_dot), temp_bytes(gathered_matmul)
    assert dense >= M * G * K * 4  # XLA:CPU still expands ragged_dot densely (else the stand-in could go)
    assert ours * 4 <= dense and ours < 64e6, (ours, dense)


def _rehearse(tmp_path, *extra, timeout, config=None):
    out = tmp_path / "rehearsal"
    p = subprocess.run([sys.executable, "-m", "dgemma", "rehearse", str(config or STAGE1), "--out", str(out), *extra],
                       cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)
    return p, out


@pytest.mark.slow  # 220 s on 2 cores; the phases' own tests (accounting, failure, SIGTERM, checks) stay default
def test_every_phase_end_to_end_on_the_tiny_config(tmp_path):
    """The reduced form in the default suite: all seven phases of `dgemma rehearse`, through the same child
    processes as the 26B rehearsal, on the shipped tiny stage-1 / stage-2 pair (1 device; ~2.5 min on 2 cores)."""
    p, out = _rehearse(tmp_path, "--devices", "1", config=TINY, timeout=1200)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    for phase in ("stage1", "kill_resume", "sdrl", "sample", "eval", "export_bf16", "export_fp8"):
        assert any(ln.startswith(phase) and " PASS " in ln for ln in lines), (phase, p.stdout)
    assert any(ln.startswith("kill_resume") and "bit-identical" in ln for ln in lines), p.stdout
    assert lines[-1].startswith("rehearse") and "7/7 phases passed" in lines[-1]
    assert (out / "export" / "fp8" / "config.json").is_file() and (out / "runs" / "sdrl" / "params").is_dir()


@pytest.mark.slow
def test_one_phase_end_to_end(tmp_path):
    """The stage-1 phase through `dgemma launch --target local` on 8 simulated devices, at one period of the layer
    pattern (the hidden test-only knob): everything else of the quick rehearsal. Slow: XLA:CPU compiles the sharded
    train step for minutes (the scan compiles one period, so fewer layers barely shorten it)."""
    p, out = _rehearse(tmp_path, "--quick", "--test-only-layers", "6", "--test-only-phases", "stage1", timeout=600)
    lines = p.stdout.splitlines()
    assert p.returncode == 0, p.stdout + p.stderr
    assert any(ln.startswith("stage1") and " PASS " in ln and "loss" in ln for ln in lines), p.stdout
    assert lines[-1].startswith("rehearse") and "PASS" in lines[-1] and "1/1 phases passed" in lines[-1]
    assert (out / "runs" / "straight" / "params").is_dir()


@pytest.mark.slow
def test_quick_rehearsal_passes_every_phase(tmp_path):
    p, out = _rehearse(tmp_path, "--quick", timeout=5400)  # 63 min at load 7-19 on the 2-core VM (docs/rehearsal.md)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    for phase in ("stage1", "kill_resume", "sdrl", "sample", "eval", "export_bf16", "export_fp8"):
        assert any(ln.startswith(phase) and " PASS " in ln for ln in lines), (phase, p.stdout)
    assert "7/7 phases passed" in lines[-1]
