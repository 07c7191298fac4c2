"""configs/chat/tiny.yaml end to end: `dgemma train` on GSM8K chat rows with the shipped tiny-chat tokenizer, stage 1
and AR; the stop ids the samplers are given are the tokenizer's (<turn|> first)."""

import json
import math
import os
import subprocess
import sys

import pytest

from dgemma.config import load_config
from dgemma.data.gsm8k_chat import write_gsm8k_chat
from dgemma.data.tokenizer import build_tokenizer
from support.scripts import REPO, load_script

CHAT = REPO / "configs/chat/tiny.yaml"
GSM8K = load_script("experiments/tiny_chat/build_data.py", "build_chat_data").GSM8K
needs_gsm8k = pytest.mark.skipif(not GSM8K.exists(), reason=f"GSM8K not found at {GSM8K} (shared/ next to the repo)")


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    return write_gsm8k_chat(str(GSM8K), str(tmp_path_factory.mktemp("chat")))


def test_the_samplers_stop_on_the_tokenizers_end_of_turn():
    from dgemma.inference.sampler_types import SamplerConfig

    cfg = load_config(CHAT, env={})
    tok = build_tokenizer(cfg.data.tokenizer)
    eot = tok.hf_tokenizer.convert_tokens_to_ids("<turn|>")
    assert tok.eos_id == eot and tok.stop_ids == (eot, 1)
    # the model's ids drive SD·RL's sampler and export; `dgemma sample` / `eval` / periodic evaluation pass stop_ids
    assert cfg.model_config.eos_token_id == tok.stop_ids and cfg.model_config.vocab_size == tok.vocab_size
    scfg = SamplerConfig.from_section(cfg.sampler, eos_ids=tuple(tok.stop_ids), pad_id=tok.pad_id)
    assert scfg.eos_ids == (eot, 1) and scfg.pad_id == 0


@pytest.mark.parametrize("path", sorted(p.relative_to(REPO).as_posix() for p in REPO.glob("configs/stage[12]/gemma4_*.yaml")))
def test_the_gemma4_family_configs_read_chat_data(path):
    data = load_config(REPO / path, env={}).data
    assert data.source == "messages" and data.tokenizer.chat and not data.add_bos, path
    if path.startswith("configs/stage2/"):  # prompts: all before a row's last answer; GSM8K's reward
        assert (data.messages.turns, data.messages.reward) == ("last", "gsm8k"), path
    else:
        assert (data.messages.turns, data.messages.thinking) == ("all", "keep"), path


@needs_gsm8k
@pytest.mark.parametrize("objective", [pytest.param("stage1", marks=pytest.mark.slow), "ar"])  # stage 1 on chat: tiny_chat --quick
def test_dgemma_train_runs_the_chat_config(tmp_path, chat_data, objective):
    """The command as a user runs it, in its own process (one CPU device, as configs/mesh/single.yaml says; the suite's
    process simulates 8)."""
    argv = ["train", "--no-progress", "-c", str(CHAT), "trainer.steps=3", f"trainer.objective={objective}",
            f"data.paths=[{chat_data['train']}]", "data.batch_size=2", f"run.output_dir={tmp_path}",
            "trainer.log_every=1"]
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES",)}
    done = subprocess.run([sys.executable, "-m", "dgemma", *argv], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "chat_tiny/metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert losses[0] < 2 * math.log(4096) + 1  # a random start over the 4,096 ids (stage 1: diffusion + AR terms)
