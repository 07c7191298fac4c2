"""The shipped tiny chat checkpoints (experiments/tiny_chat/checkpoint/) load under configs/chat/tiny.yaml with the
shipped tokenizer and are the trained models: the stage-0 model scores a GSM8K-style answer far better than the same
architecture at random weights (a missing, corrupt or mismatched checkpoint, or another tokenizer, would not), and
`dgemma sample` on the stage-1 model streams an answer as text and says why it stopped."""

from pathlib import Path

import numpy as np

from dgemma.cli.main import main

REPO = Path(__file__).resolve().parents[2]
CHAT = REPO / "configs/chat/tiny.yaml"
SHIPPED = REPO / "experiments/tiny_chat/checkpoint"
QUESTION = "Tom has 3 apples and buys 5 more. How many apples does he have?"  # not a GSM8K row
ANSWER = "Tom has 3+5=<<3+5=8>>8 apples.\n#### 8"


def _perplexity(model, tok) -> float:
    from dgemma.data.chat import chat_prompt_ids
    from dgemma.eval.genppl import generative_perplexity

    prompt = np.asarray([chat_prompt_ids(tok.hf_tokenizer, QUESTION)], np.int32)
    answer = [*tok.encode(ANSWER), int(tok.stop_ids[0])]  # the answer and its <turn|>
    return generative_perplexity(model, prompt, np.ones_like(prompt, bool), [answer])["gen_ppl"]


def test_the_stage0_checkpoint_is_the_trained_model():
    from flax import nnx

    from dgemma.checkpoint.model import restore_model
    from dgemma.config import load_config
    from dgemma.data.tokenizer import HFTokenizer
    from dgemma.model.transformer import Transformer

    cfg = load_config(CHAT, [], env={})
    tok = HFTokenizer("dgemma:tiny_chat", chat=True)
    from dgemma.parallel.mesh import make_mesh

    trained = restore_model(cfg.model_config, str(SHIPPED / "stage0_ar"), mesh=make_mesh({"fsdp": -1}),
                            rules=cfg.mesh.rules)[0]
    random = Transformer(cfg.model_config, rngs=nnx.Rngs(0))
    ppl_trained, ppl_random = _perplexity(trained, tok), _perplexity(random, tok)
    assert ppl_random > 1000 and ppl_trained < 100, (ppl_trained, ppl_random)  # random: about V = 4,096


def test_sample_from_the_shipped_stage1_checkpoint(capsys):
    rc = main(["sample", "-c", str(CHAT), "--checkpoint", str(SHIPPED / "stage1"), "--prompt", QUESTION,
               "--mode", "diffusion", "sampler.max_new_tokens=32", "sampler.max_steps=4"])
    assert rc == 0
    out = capsys.readouterr().out
    text, stop = out.split("\n[stop: ", 1)
    assert len(text.strip()) > 0 and "tokens/forward" in stop
