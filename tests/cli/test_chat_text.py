"""Chat text in and out without a model: the shipped tiny-chat tokenizer's real template renders `--messages`
conversations and `--raw` prompts, `read_conversation` refuses bad files in one line naming the file, and the text
stream prints committed blocks as whole characters, up to the end of the turn and nothing after it."""

import json

import numpy as np
import pytest

from dgemma.cli.answers import TextStream, answer_text, cut_answer, stop_reason
from dgemma.cli.sample import encode_prompts
from dgemma.data.chat import conversation_prompt_ids, read_conversation
from dgemma.data.tokenizer import HFTokenizer

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 12+30?"},
    {"role": "assistant", "content": "12 + 30 = 42\n#### 42", "thinking": "Add."},
    {"role": "user", "content": "And twice that?"},
]


@pytest.fixture(scope="module")
def tok():
    return HFTokenizer("dgemma:tiny_chat", chat=True)


def _blocks(ids, L):
    """`ids` as the sampler commits them: canvases of L, the first stop kept and PAD after it, later blocks PAD."""
    out = np.zeros((-(-len(ids) // L)) * L, np.int32)
    out[:len(ids)] = ids
    return out.reshape(-1, L)


@pytest.mark.parametrize("thinking", ["keep", "drop"])
def test_a_conversation_renders_as_the_context_of_the_next_assistant_turn(tok, thinking):
    hf = tok.hf_tokenizer
    ids = conversation_prompt_ids(hf, CONVERSATION, thinking=thinking)
    msgs = CONVERSATION if thinking == "keep" else [{"role": m["role"], "content": m["content"]} for m in CONVERSATION]
    kw = {"enable_thinking": True} if thinking == "keep" else {}
    want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kw)
    assert hf.decode(ids) == want and want.endswith("And twice that?<turn|>\n<|turn>model\n")
    assert ("<|channel>thought\nAdd.<channel|>" in want) == ("<|think|>" in want) == (thinking == "keep")
    # exactly the context training gives the answer to this turn (dgemma.data.chat.chat_turns)
    from dgemma.data.chat import chat_turns

    answered = CONVERSATION + [{"role": "assistant", "content": "84"}]
    assert chat_turns(hf, answered, thinking=thinking)[-1][1] == ids


def test_raw_sends_the_text_as_it_is(tok):
    templated, _ = encode_prompts(tok, ["What is 2+2?"], add_bos=False)
    by_hand = "<bos><|turn>user\nWhat is 2+2?<turn|>\n<|turn>model\n"
    raw, valid = encode_prompts(tok, [by_hand], add_bos=False, raw=True)
    assert raw.tolist() == templated.tolist() and valid.all()
    plain, _ = encode_prompts(tok, ["What is 2+2?"], add_bos=False, raw=True)
    assert tok.decode(plain[0]) == "What is 2+2?"


@pytest.mark.parametrize("body, needle", [
    (None, "no such file"),
    ("{not json", "not JSON (Expecting property name"),
    ('{"messages": [{"role": "user", "content": "a"}]}\n{"messages": []}\n', "2 JSON lines"),
    ('{"turns": []}', "without a 'messages' list"),
    ('{"messages": []}', "no 'messages'"),
    ('[{"role": "bot", "content": "hi"}]', "message 0: unknown role 'bot'"),
    ('[{"role": "user", "content": 3}]', "content must be text"),
    ('[{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]', "a system message must come first"),
    ('[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]', "ends on an assistant turn"),
])
def test_read_conversation_refuses_bad_files_naming_them(tmp_path, body, needle):
    path = tmp_path / "conv.json"
    if body is not None:
        path.write_text(body)
    with pytest.raises(ValueError) as e:
        read_conversation(str(path))
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and needle in msg and "\n" not in msg, msg


def test_read_conversation_takes_an_object_or_a_bare_list(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"messages": CONVERSATION}))
    b.write_text(json.dumps(CONVERSATION))
    assert read_conversation(str(a)) == read_conversation(str(b)) == CONVERSATION


def test_the_stream_prints_whole_characters_across_blocks_and_stops_at_the_end_of_turn(tok):
    hf = tok.hf_tokenizer
    text = "It costs 5 € (café ☕)."
    ids = hf.encode(text, add_special_tokens=False)
    euro = hf.encode("€", add_special_tokens=False)
    assert len(euro) == 3  # byte pieces: a block boundary can fall inside the character
    eot = hf.convert_tokens_to_ids("<turn|>")
    # after the end of turn the model wrote more; the sampler keeps the first stop and pads what follows
    tail = hf.encode(" and more", add_special_tokens=False)
    L = ids.index(euro[0]) + 1  # the first block ends on the first byte of €
    blocks = _blocks(ids + [eot] + [tok.pad_id] * len(tail), L)
    printed = []
    stream = TextStream(tok, 1, write=printed.append)
    for b, block in enumerate(blocks):
        stream.on_block(b, block[None])
    answers = stream.finish(blocks.reshape(1, -1))
    assert "".join(printed) == text + "\n"
    assert all("\ufffd" not in p for p in printed) and len(printed) >= 3  # streamed in pieces, never a broken char
    assert printed[0] == text[:text.index("€")]
    assert answers[0].ids == ids and answers[0].stop == eot
    assert stop_reason(tok, answers[0], 64) == "end of turn (<turn|>)"


def test_several_rows_stream_one_line_per_row_and_block(tok):
    hf = tok.hf_tokenizer
    eot = hf.convert_tokens_to_ids("<turn|>")
    first, second = (hf.encode(t, add_special_tokens=False) for t in ("The answer is 42 because 6 x 7 = 42", "No."))
    assert 12 < len(first) <= 24
    rows = np.zeros((2, 24), np.int32)
    rows[0, :len(first)] = first  # runs to the budget: no stop
    rows[1, :len(second) + 1] = second + [eot]
    printed = []
    stream = TextStream(tok, 2, write=printed.append)
    stream.on_block(0, rows[:, :12])
    stream.on_block(1, rows[:, 12:])
    answers = stream.finish(rows)
    assert printed[0] == f"[block 0] prompt 1: {hf.decode(first[:12])!r}\n"
    assert printed[1] == "[block 0] prompt 2: 'No.'\n"
    assert printed[2] == f"[block 1] prompt 1: {hf.decode(first)[len(hf.decode(first[:12])):]!r}\n"
    assert len(printed) == 3  # the finished row prints nothing more
    assert [a.stop for a in answers] == [None, eot]
    assert stop_reason(tok, answers[0], 24).startswith("token budget (sampler.max_new_tokens=24")
    # all-AR decoding never streams: finish prints each answer whole
    printed.clear()
    TextStream(tok, 2, write=printed.append).finish(rows)
    assert printed == [f"[end] prompt 1: {hf.decode(first)!r}\n", "[end] prompt 2: 'No.'\n"]


def test_answers_keep_the_models_pads_but_not_the_trailing_ones(tok):
    eot, eos = tok.stop_ids
    assert cut_answer(tok, [40, 0, 41, 0, 0]).ids == [40, 0, 41]
    assert cut_answer(tok, [40, eos, 41]) == cut_answer(tok, [40, eos, 0])
    assert stop_reason(tok, cut_answer(tok, [40, eos]), 8) == "stop token <eos>"
    assert answer_text(tok, [40, 0, 41, eot, 42]) == tok.decode([40, 0, 41])
