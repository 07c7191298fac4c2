"""experiments/tiny_chat/seeds.py: the table over seeds reads each run's metrics.json as run.py writes it (the keys
below are the ones run.py's `main` fills) and reports the mean, the range and the CI of every measure."""

import json

import pytest
from support.scripts import load_script

seeds = load_script("experiments/tiny_chat/seeds.py", "tiny_chat_seeds")


def metrics(x: float, quick: bool = False) -> dict:
    """A run's metrics.json with every number a function of `x` (one value per seed)."""
    ppl = lambda v: {"gen_ppl": v, "nll": 1.0, "tokens": 10}  # noqa: E731
    dec = lambda em, **extra: {"settings": "s", "metrics": {"exact_match": em, "tpf": 2 * x, "n": 8, **extra},  # noqa: E731
                               "gen_ppl": ppl(10 * x), "unigram_entropy": x, "format_share": x / 2, "keys": 3,
                               "per_prompt_entropy": [x / 4, 0, 1], "per_prompt_entropy_max": 1.0986, "distinct": x / 3}
    return {"machine": "m", "quick": quick, "eval_rows": 8, "data": "d",
            "reference": {"gen_ppl": ppl(5 * x), "unigram_entropy": 2 * x, "format_share": 1.0},
            "decodings": {"stage 0, AR": dec(x / 10), "stage 1, diffusion": dec(x / 5, steps_per_block=3 * x)},
            "throughput": {"ar": {"tokens_per_second": 10 * x}, "diffusion": {"tokens_per_second": 20 * x}},
            "total_seconds": 100 * x, "total_cpu_seconds": 150 * x}


def write(tmp_path, name: str, m: dict) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "metrics.json").write_text(json.dumps(m))
    return str(d)


def test_mean_range_and_ci_over_seeds(tmp_path):
    dirs = [write(tmp_path, f"s{i}", metrics(x)) for i, x in enumerate([1.0, 2.0, 4.0])]
    assert seeds.main([*dirs, "--out", str(tmp_path / "out")]) == 0
    table = json.loads((tmp_path / "out" / "results.json").read_text())["table"]
    diff = table["stage 1, diffusion"]
    assert diff["steps_per_block"]["mean"] == pytest.approx(7.0) and diff["steps_per_block"]["seeds"] == [3, 6, 12]
    assert (diff["gen_ppl"]["min"], diff["gen_ppl"]["max"]) == (10.0, 40.0)
    assert 10.0 <= diff["gen_ppl"]["ci95"][0] <= diff["gen_ppl"]["ci95"][1] <= 40.0
    assert "steps_per_block" not in table["stage 0, AR"]  # AR has no denoising steps
    assert table["reference answers"]["gen_ppl"]["mean"] == pytest.approx(5 * 7 / 3)
    assert table["tokens per second, batch 1"]["diffusion / AR"]["seeds"] == [2.0, 2.0, 2.0]
    md = (tmp_path / "out" / "results.md").read_text()
    assert "| stage 1, diffusion | 0.467 (0.200-0.800) |" in md  # exact match x / 5
    assert (tmp_path / "out" / "seeds.png").stat().st_size > 0


def test_refuses_missing_runs_and_unlike_runs(tmp_path, capsys):
    a = write(tmp_path, "a", metrics(1.0))
    assert seeds.main([a, str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "nope/metrics.json: no such file" in capsys.readouterr().err
    b = write(tmp_path, "b", metrics(2.0, quick=True))
    assert seeds.main([a, b, "--out", str(tmp_path / "o")]) == 2
    assert "differ in --quick" in capsys.readouterr().err
    assert seeds.main([a, "--out", str(tmp_path / "o")]) == 2
    assert not (tmp_path / "o").exists()
