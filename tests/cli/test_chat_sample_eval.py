"""Text in, text out on configs/chat/tiny.yaml (the shipped tiny-chat tokenizer and its real chat template; two layers,
tiny canvases): `dgemma sample` streams the answer as text, ends at `<turn|>` and says why it stopped, takes `--raw`
and `--messages`; `dgemma eval --data` scores a messages jsonl per mode (GSM8K's `#### N`, or the answer's exact text)
with the answers as text. Two checkpoints made here: random weights, and weights built so that every position's argmax
is `<turn|>` (the embedding row of `<turn|>` is the others' times 4 and the sublayers add nothing: the logits do not
depend on the input, and `<turn|>`'s is the largest)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from support.cli_errors import one_line_error
from dgemma.cli.answers import answer_text
from dgemma.cli.main import main

REPO = Path(__file__).resolve().parents[2]
CHAT = str(REPO / "configs/chat/tiny.yaml")
SMALL = ["model.num_hidden_layers=2", "model.layer_types=[sliding_attention,full_attention]", "sampler.max_steps=3",
         "sampler.max_new_tokens=64"]
EOT = 6  # the tiny-chat tokenizer's <turn|>


def _end_of_turn_weights(model):
    import jax.numpy as jnp

    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    for path, var in flat:
        name = ".".join(map(str, path))
        if name == "embedder.embedding":
            v = np.full(var.shape, 0.1, np.float32)
            v[EOT] *= 4.0
        elif name == "final_norm.scale":
            v = np.ones(var.shape, np.float32)
        elif name.endswith(("post_attn_norm.scale", "post_ffw_norm.scale")) or name == "self_conditioning.mlp.down":
            v = np.zeros(var.shape, np.float32)  # the sublayers add nothing to the residual stream
        else:
            continue
        var.set_value(jnp.asarray(v, var.dtype))
    nnx.update(model, nnx.from_flat_state(flat))
    return model


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from dgemma.checkpoint import save_params
    from dgemma.config import load_config
    from dgemma.model.transformer import Transformer

    root = tmp_path_factory.mktemp("chat_ckpts")
    cfg = load_config(CHAT, SMALL, env={})
    save_params(root / "random", 1, nnx.state(Transformer(cfg.model_config, rngs=nnx.Rngs(0)), nnx.Param))
    eot = _end_of_turn_weights(Transformer(cfg.model_config, rngs=nnx.Rngs(0)))
    save_params(root / "eot", 1, nnx.state(eot, nnx.Param))
    return {"random": str(root / "random"), "eot": str(root / "eot")}


def _chat_rows(pairs):
    return "".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
                   + "\n" for q, a in pairs)


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_data")
    files = {
        "train": [("What is 2+3?", "2+3=5\n#### 5"), ("What is 4+4?", "4+4=8\n#### 8")],
        "heldout": [("What is 1+6?", "1+6=7\n#### 7"), ("What is 9+0?", "9+0=9\n#### 9"),
                    ("What is 3+3?", "3+3=6\n#### 6")],
        "heldout_text": [("Say nothing.", ""), ("Say hi.", "hi")],
    }
    for name, pairs in files.items():
        (root / f"{name}.jsonl").write_text(_chat_rows(pairs))
    return {name: str(root / f"{name}.jsonl") for name in files}


def _sample(ckpt, *args):
    return main(["sample", "-c", CHAT, "--checkpoint", ckpt, *SMALL, *args])


def _sampled_text(ckpt, prompt_ids, mode="diffusion"):
    """The answer text of the sampler run directly on `prompt_ids`, as `dgemma sample` runs it (seed 0)."""
    import jax

    from dgemma.cli import common
    from dgemma.config import load_config
    from dgemma.data.tokenizer import build_tokenizer
    from dgemma.inference.sampler import SamplerConfig, sample

    cfg = load_config(CHAT, SMALL, env={})
    tok = build_tokenizer(cfg.data.tokenizer)
    model, _ = common.restore_model(cfg, ckpt, sampling=True)
    scfg = SamplerConfig.from_section(cfg.sampler, eos_ids=tuple(tok.stop_ids), pad_id=tok.pad_id, mode=mode)
    ids = np.asarray([prompt_ids], np.int32)
    res = sample(model, ids, np.ones_like(ids, bool), scfg, jax.random.key(0), mode, mesh=common.run_mesh(cfg.mesh),
                 rules=cfg.mesh.rules)
    return answer_text(tok, res.tokens[0])


def test_sample_streams_the_answer_as_text(ckpts, capsys):
    from dgemma.data.chat import chat_prompt_ids
    from dgemma.data.tokenizer import HFTokenizer

    tok = HFTokenizer("dgemma:tiny_chat", chat=True)
    assert _sample(ckpts["random"], "--prompt", "What is 2+3?", "--mode", "diffusion") == 0
    out = capsys.readouterr().out
    streamed, stop = out.split("\n[stop: ", 1)
    # the text the sampler's tokens decode to, nothing else (no block headers, no ids): random weights run to the budget
    want = _sampled_text(ckpts["random"], chat_prompt_ids(tok.hf_tokenizer, "What is 2+3?"))
    assert streamed == want and len(want) > 20
    assert stop.startswith("token budget (sampler.max_new_tokens=64") and "64 tokens, tokens/forward" in stop
    assert "steps_mean=3.000" in stop
    # --raw: the same prompt written by hand is the same prompt, so the same answer
    by_hand = "<bos><|turn>user\nWhat is 2+3?<turn|>\n<|turn>model\n"
    assert _sample(ckpts["random"], "--raw", "--prompt", by_hand, "--mode", "diffusion") == 0
    assert capsys.readouterr().out.split("\n[stop: ", 1)[0] == want


def test_several_prompts_stream_block_by_block(ckpts, capsys):
    prompts = ["What is 2+3?", "Hello"]
    assert _sample(ckpts["random"], "--prompt", prompts[0], "--prompt", prompts[1], "--mode", "diffusion") == 0
    lines = capsys.readouterr().out.splitlines()
    blocks_streamed = []
    for i, prompt in enumerate(prompts, 1):
        streamed = [ln for ln in lines if f"] prompt {i}: " in ln]
        blocks_streamed.append([ln.split("]")[0] for ln in streamed])
        whole = next(ln for ln in lines if ln.startswith(f"prompt {i} {prompt!r} -> "))
        # the pieces, in block order, make the answer
        assert "".join(eval(ln.split(f"] prompt {i}: ", 1)[1]) for ln in streamed) == eval(whole.split(" -> ", 1)[1])
    # the 64-token budget is two canvases: a row that does not stop early streams both as they commit
    assert ["[block 0", "[block 1"] in blocks_streamed, lines


def test_sample_stops_at_the_end_of_turn(ckpts, tmp_path, capsys):
    conv = tmp_path / "conv.json"
    conv.write_text(json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "What is 2+3?"},
                                             {"role": "assistant", "content": "5"},
                                             {"role": "user", "content": "And 2+4?"}]}))
    for how in (["--prompt", "What is 2+3?"], ["--messages", str(conv)]):
        assert _sample(ckpts["eot"], *how, "--mode", "diffusion") == 0
        out = capsys.readouterr().out.splitlines()
        # nothing before the stop (the first committed token ends the turn), nothing of the 31 <turn|> after it; the
        # second canvas of the 64-token budget never runs
        assert out[0].startswith("[stop: end of turn (<turn|>); 0 tokens, tokens/forward ") and len(out) == 2, out
        passes = int(out[1].split("decoder_passes=")[1].split()[0])
        assert 1 <= passes <= 3, out  # sampler.max_steps=3: one block


def test_sample_refuses_chat_misuse_in_one_line(ckpts, tmp_path, capsys):
    conv = tmp_path / "conv.json"
    conv.write_text(json.dumps([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]))
    ck = ckpts["random"]
    assert _sample(ck, "--messages", str(conv), "--prompt", "hi") == 2
    one_line_error(capsys, "dgemma sample: --messages FILE is the whole conversation")
    assert _sample(ck, "--messages", str(conv), "--raw") == 2
    one_line_error(capsys, "--raw sends prompt text without the chat template")
    assert _sample(ck, "--messages", str(conv)) == 2
    one_line_error(capsys, f"--messages {conv}: ", "ends on an assistant turn")
    assert _sample(ck, "--messages", str(tmp_path / "nope.json")) == 2
    one_line_error(capsys, f"--messages {tmp_path / 'nope.json'}: no such file")
    assert _sample(ck, "--prompt", " ") == 2
    one_line_error(capsys, "--prompt number 1 is empty")
    # a toy config has no chat template
    assert main(["sample", "-c", str(REPO / "configs/stage1/tiny.yaml"), "--checkpoint", ck, "--messages",
                 str(conv)]) == 2
    one_line_error(capsys, "needs a chat tokenizer", "kind='toy'")
    # a chat config whose tokenizer has no chat template
    bare = tmp_path / "no_template"
    from dgemma.data.tokenizer import shipped_tokenizer_dir

    shutil.copytree(shipped_tokenizer_dir("dgemma:tiny_chat"), bare)
    (bare / "chat_template.jinja").unlink()
    assert _sample(ck, f"data.tokenizer.path={bare}", "--prompt", "hi") == 2
    one_line_error(capsys, "data.tokenizer", str(bare), "no chat_template")


def test_eval_scores_a_messages_file(ckpts, chat_files, tmp_path, capsys):
    data = [f"data.paths=[{chat_files['train']}]", "data.layout.prompt_len=64", "data.layout.n_blocks=1",
            "trainer.steps=1"]
    ev = ["eval", "-c", CHAT, *SMALL, *data, "--batch-size", "3"]
    assert main([*ev, "--checkpoint", ckpts["random"], "--data", chat_files["heldout"], "--modes", "ar,diffusion",
                 "--plot-dir", str(tmp_path / "ev")]) == 0
    out = capsys.readouterr().out
    assert "3 held-out prompts {'gsm8k': 3}" in out and "overlap with the training stream: 0" in out
    assert "gsm8k" in out and "diffusion: tokens/forward" in out and "steps/block 3.00" in out
    res = json.loads((tmp_path / "ev" / "eval.json").read_text())
    for mode in ("ar", "diffusion"):
        rows = res[mode]["rows"]
        assert res[mode]["metrics"]["n"] == 3 and rows["reference"] == ["7", "9", "6"]
        assert rows["text"] == [answer_text_of(o) for o in rows["output"]]
        assert f"{chat_files['heldout']}:1: reward 0  {rows['text'][0]!r}  (reference '7')" in out
    # the answer's exact text (data.messages.reward: text): the end-of-turn model answers "" right and "hi" wrong
    assert main([*ev, "data.messages.reward=text", "--checkpoint", ckpts["eot"], "--data",
                 chat_files["heldout_text"], "--modes", "diffusion", "--plot-dir", str(tmp_path / "ev2")]) == 0
    out = capsys.readouterr().out
    res = json.loads((tmp_path / "ev2" / "eval.json").read_text())["diffusion"]
    assert res["metrics"]["exact_match"] == 0.5 and res["rows"]["reward"] == [1.0, 0.0]
    assert res["rows"]["text"] == ["", ""] and res["rows"]["reference"] == ["", "hi"]
    assert "all".ljust(8) + f"{0.5:11.3f}" in out


def answer_text_of(ids):
    from dgemma.data.tokenizer import HFTokenizer

    return answer_text(HFTokenizer("dgemma:tiny_chat", chat=True), ids)


def test_eval_refuses_data_misuse_in_one_line(ckpts, chat_files, capsys):
    ck = ckpts["random"]
    data = [f"data.paths=[{chat_files['train']}]", "data.layout.prompt_len=64", "data.layout.n_blocks=1",
            "trainer.steps=1"]
    assert main(["eval", "-c", CHAT, *SMALL, *data, "--checkpoint", ck]) == 2
    one_line_error(capsys, "data.source='messages': give the held-out rows with --data FILE")
    assert main(["eval", "-c", CHAT, *SMALL, *data, "--checkpoint", ck, "--data", chat_files["train"]]) == 2
    one_line_error(capsys, f"--data {chat_files['train']}: 2 of its 2 prompts occur in the training stream",
                   f"first: {chat_files['train']}:1", "--train-steps 0")
    assert main(["eval", "-c", CHAT, *SMALL, *data, "--checkpoint", ck, "--data", "nope.jsonl"]) == 2
    one_line_error(capsys, "--data nope.jsonl: no such file")
    assert main(["eval", "-c", str(REPO / "configs/stage1/tiny.yaml"), "--checkpoint", ck, "--data",
                 chat_files["heldout"]]) == 2
    one_line_error(capsys, "data.source=synthetic", "drop --data")
