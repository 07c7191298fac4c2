"""A user reward (`sdrl.reward: "pkg.mod:fn"`) that cannot be imported, or that calls sys.exit, is one RewardError line
naming the setting, the module or function and what happened; never a traceback, never a silent exit 0."""

from __future__ import annotations

import textwrap
import uuid
from pathlib import Path

import pytest

from dgemma.data.rewards import RewardError, TaskExample, load_reward_fn, score_rows

REPO = Path(__file__).resolve().parents[2]


def _module(tmp_path, monkeypatch, body: str) -> str:
    """Write a module with a fresh name (no sys.modules reuse across tests) on sys.path; return its name."""
    name = f"user_reward_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _error(path: str) -> str:
    with pytest.raises(RewardError) as info:
        load_reward_fn(path)
    msg = str(info.value)
    assert len(msg.splitlines()) == 1 and msg.startswith(f"sdrl.reward={path!r}"), msg
    return msg


def test_a_syntax_error_names_the_file_and_line(tmp_path, monkeypatch):
    name = _module(tmp_path, monkeypatch, "def reward(examples, generations, tokenizer):\n    return [1.0]\nif x ==:\n")
    msg = _error(f"{name}:reward")
    assert f"cannot import module {name!r} (SyntaxError: invalid syntax at {tmp_path / name}.py:3)" in msg


@pytest.mark.parametrize("body, expected", [
    ("import not_installed_pkg_zz\n", "(ModuleNotFoundError: No module named 'not_installed_pkg_zz')"),
    ("raise RuntimeError('needs a GPU')\n", "(RuntimeError: needs a GPU)"),
    ("import sys\nsys.exit(0)\n", "(it called sys.exit(0))"),
])
def test_a_module_failing_at_import_is_one_line(body, expected, tmp_path, monkeypatch):
    name = _module(tmp_path, monkeypatch, body)
    assert expected in _error(f"{name}:reward")


def test_a_missing_module_and_a_missing_function(tmp_path, monkeypatch):
    assert "cannot import module 'no_such_reward_module' (ModuleNotFoundError" in _error("no_such_reward_module:fn")
    name = _module(tmp_path, monkeypatch, "def other(*a):\n    return [1.0]\n")
    assert f"module {name!r} has no callable 'reward'" in _error(f"{name}.reward")


@pytest.mark.parametrize("raise_line, shown", [
    ("sys.exit(0)", "raised SystemExit (it called sys.exit(0))"),
    ("raise SystemExit('done')", "raised SystemExit (it called sys.exit('done'))"),
    ("raise Stop()", "raised Stop (Stop)"),
])
def test_a_reward_that_exits_is_an_error_naming_it(raise_line, shown, tmp_path, monkeypatch):
    name = _module(tmp_path, monkeypatch, f"""
        import sys

        class Stop(BaseException):
            pass

        def reward(examples, generations, tokenizer):
            {raise_line}
        """)
    fn = load_reward_fn(f"{name}:reward")
    example = TaskExample(task="copy", prompt="C12|", response="12", answer="12")
    with pytest.raises(RewardError) as info:
        score_rows([example], [[7, 8, 1]], fn=fn)
    msg = str(info.value)
    assert msg == (f"sdrl.reward='{name}:reward': reward function reward {shown}; a reward must return one float "
                   f"per row"), msg


def test_a_working_reward_is_called_through_the_wrapper(tmp_path, monkeypatch):
    name = _module(tmp_path, monkeypatch, """
        def reward(examples, generations, tokenizer):
            return [float(len(g)) for g in generations]
        """)
    fn = load_reward_fn(f"{name}.reward")
    assert fn.__name__ == "reward"
    example = TaskExample(task="copy", prompt="C12|", response="12", answer="12")
    assert score_rows([example, example], [[7, 8, 1], [7]], fn=fn).tolist() == [3.0, 1.0]


def test_dgemma_train_with_an_exiting_reward_fails_with_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from dgemma.cli.main import main

    name = _module(tmp_path, monkeypatch, "import sys\n\ndef reward(examples, generations, tokenizer):\n"
                                          "    sys.exit(0)\n")
    out = tmp_path / "runs"
    argv = ["train", "-c", str(REPO / "configs/stage2/tiny.yaml"), "--no-progress", "trainer.steps=1",
            "mesh.ici={fsdp: -1}", "data.batch_size=8", "sdrl.group_size=2", f"sdrl.reward={name}:reward",
            f"checkpoint.init_from={REPO / 'experiments/sdrl_study/checkpoint/stage1_toy'}", f"run.output_dir={out}"]
    assert main(argv) == 2  # `dgemma train --help`: a failing reward function (sdrl.reward) is a bad config
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"sdrl.reward='{name}:reward': reward function reward raised SystemExit" in err
    assert not out.exists()


def test_an_id_outside_the_tokenizer_vocabulary_scores_zero_instead_of_failing():
    """A model whose vocabulary is larger than the toy tokenizer's (32) can sample id 65: a wrong answer, not an
    error that ends the run's evaluation."""
    from dgemma.data.rewards import reward
    from dgemma.data.tokenizer import ToyTokenizer

    tok = ToyTokenizer()
    example = TaskExample(task="copy", prompt="C12|", response="12", answer="12")
    right = tok.encode("12") + [tok.eos_id]
    assert reward(example, right, tok) == 1.0
    assert reward(example, [65, *right], tok) == 0.0
    assert reward(example, right + [65], tok) == 1.0  # after the EOS: ignored
    assert score_rows([example, example], [right, [7, 65, 1]], tok).tolist() == [1.0, 0.0]
