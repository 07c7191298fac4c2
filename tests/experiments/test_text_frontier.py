"""experiments/tiny_chat/text_frontier.py: bad input refused in one line before any work (and an used --out never
touched), and its table and plot from a results dict shaped as `main` fills it."""

import subprocess
import sys
from pathlib import Path

import pytest
from support.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = "experiments/tiny_chat/text_frontier.py"
text_frontier = load_script(SCRIPT, "tiny_chat_text_frontier")


@pytest.mark.parametrize("args, says", [
    (["--stage1", "no/such/dir"], "--stage1 no/such/dir: no such checkpoint directory"),
    (["--settings", "EB default", "K 99"], "--settings ['K 99']: not in the ladder"),
    (["--keys", "1"], "--keys 1 (>= 2)"),
    (["--rows", "10", "--batch", "8"], "rows a positive multiple of batch"),
])
def test_bad_arguments_are_refused_in_one_line(args, says, tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, *args, "--out", str(tmp_path / "new")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and says in lines[0], proc.stderr
    assert not (tmp_path / "new").exists()


def test_an_used_out_is_never_overwritten(tmp_path):
    used = tmp_path / "used"
    used.mkdir()
    (used / "text_frontier.json").write_text("keep")
    assert text_frontier.main(["--out", str(used)]) == 2
    assert (used / "text_frontier.json").read_text() == "keep"


def _row(label, spb, ppl, h, keys=True):
    row = {"label": label, "settings": f"{label} settings", "steps_per_block": spb, "tokens_per_forward": 1.5,
           "exact_match": 0.0, "gen_ppl": {"gen_ppl": ppl, "nll": 1.0, "tokens": 9}, "unigram_entropy": h,
           "format_share": 0.25}
    if keys:
        row["per_prompt_entropy"] = (1.05, 1.0, 1.09)
    return row


def test_table_and_plot_show_every_row_with_perplexity_beside_entropy(tmp_path):
    r = {"machine": "m", "stage0": "s0", "stage1": "s1", "rows": 8, "keys": 3, "seed": 0, "total_seconds": 10.0,
         "total_cpu_seconds": 12.0, "reference": {"gen_ppl": {"gen_ppl": 20.5}, "unigram_entropy": 4.5},
         "stage0_ar": _row("stage 0, AR (greedy)", None, 1.7, 1.4, keys=False),
         "ladder": [_row("EB default", 29.3, 50.0, 3.1), _row("fixed-count K 4", 4.0, 84.2, 3.0)]}
    md = text_frontier.report_md(r)
    lines = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(lines) == 4  # header + 3 decodings
    assert "| fixed-count K 4 | 4.00 | 1.50 | 84.20 | 3.00 | 1.050 [1.000, 1.090] | 0.25 | 0.000 |" in md
    assert "| stage 0, AR (greedy) | – | 1.50 | 1.70 | 1.40 | – (greedy) |" in md
    assert "generative perplexity 20.50, unigram entropy 4.50" in md
    text_frontier.plot(r, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000
