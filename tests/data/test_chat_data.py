"""Conversations as data: the shipped tiny-chat tokenizer's real chat template, `messages` rows from real jsonl /
parquet files and a `datasets.Dataset`, the turn split (context + target == the template's rendering, token for
token), thinking kept / dropped, malformed rows refused or skipped with file and row named, EOS / stop = <turn|>,
no truncation, GSM8K's reward on chat rows."""

import json
import logging

import numpy as np
import pytest

from dgemma.data.chat import BadRow, chat_turns, check_messages
from dgemma.data.config import DataConfig, MessagesConfig, TokenizerConfig
from dgemma.data.messages import MessagesSource
from dgemma.data.pipeline import DataPipeline
from dgemma.data.rewards import reward
from dgemma.data.sources import build_source
from dgemma.data.tokenizer import HFTokenizer, build_tokenizer

TOK_CFG = {"kind": "hf", "path": "dgemma:tiny_chat", "chat": True}
SYSTEM = {"role": "system", "content": "You are terse."}
THREE_TURNS = [
    SYSTEM,
    {"role": "user", "content": "What is 12+30?"},
    {"role": "assistant", "content": "12 + 30 = 42\n#### 42", "thinking": "Add the tens, then the units."},
    {"role": "user", "content": "And twice that?"},
    {"role": "assistant", "content": "2 * 42 = 84\n#### 84", "thinking": "Double it."},
    {"role": "user", "content": "Thanks."},
    {"role": "assistant", "content": "You're welcome."},
]


@pytest.fixture(scope="module")
def tok():
    return HFTokenizer("dgemma:tiny_chat", chat=True)


def _cfg(paths=(), **kw):
    layout = kw.pop("layout", {"prompt_len": 128, "n_blocks": 4, "canvas_length": 32})
    return DataConfig(source="messages", paths=tuple(map(str, paths)), add_bos=False, tokenizer=TOK_CFG,
                      layout=layout, shuffle=False, num_threads=0, batch_size=2, **kw)


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_chat_tokenizer_ends_answers_on_end_of_turn(tok):
    hf = tok.hf_tokenizer
    eot, eos = hf.convert_tokens_to_ids("<turn|>"), hf.convert_tokens_to_ids("<eos>")
    assert tok.eos_id == eot and tok.eos_token == "<turn|>" and tok.stop_ids == (eot, eos)
    assert (tok.pad_id, tok.bos_id, eos) == (0, 2, 1)
    plain = HFTokenizer("dgemma:tiny_chat")  # no chat: the document EOS, as before
    assert plain.eos_id == 1 and plain.stop_ids == (1,)
    with pytest.raises(ValueError, match="no shipped tokenizer 'dgemma:nope'"):
        HFTokenizer("dgemma:nope")


@pytest.mark.parametrize("thinking", ["keep", "drop"])
@pytest.mark.parametrize("system", [True, False])
def test_context_plus_target_is_the_template_through_each_turn(tok, thinking, system):
    hf = tok.hf_tokenizer
    msgs = check_messages({"messages": THREE_TURNS if system else THREE_TURNS[1:]})
    turns = chat_turns(hf, msgs, thinking=thinking)
    offset = 0 if system else 1
    assert [k + offset for k, _, _ in turns] == [2, 4, 6]
    rendered = msgs if thinking == "keep" else [{"role": m["role"], "content": m["content"]} for m in msgs]
    enable = {"enable_thinking": True} if thinking == "keep" else {}
    for k, context, target in turns:
        full = hf.apply_chat_template(rendered[:k + 1], tokenize=False, **enable)
        # the rendering through turn k ends "<turn|>\n": the newline opens the next turn's context
        assert full.endswith("<turn|>\n")
        assert context + target + [tok.eos_id] == hf.encode(full[:-1], add_special_tokens=False)
        assert hf.decode(context).endswith("<|turn>model\n")
        text = hf.decode(target)
        assert text.endswith(msgs[k]["content"])
        has_thought = "<|channel>thought\n" in text
        assert has_thought == (thinking == "keep" and "thinking" in msgs[k])
        assert ("<|think|>" in hf.decode(context)) == (thinking == "keep")
        if has_thought:
            assert text == f"<|channel>thought\n{msgs[k]['thinking']}<channel|>{msgs[k]['content']}"
    # a later turn's context holds the earlier answers, with their thoughts only when kept
    last_context = hf.decode(turns[-1][1])
    assert "2 * 42 = 84\n#### 84<turn|>" in last_context
    assert ("Double it." in last_context) == (thinking == "keep")


def test_messages_source_jsonl_parquet_and_dataset_agree(tmp_path, tok):
    import datasets

    rows = [{"messages": THREE_TURNS}, {"messages": [{"role": "user", "content": "Hi"},
                                                     {"role": "assistant", "content": "Hello."}]}]
    jsonl = _write_jsonl(tmp_path / "chat.jsonl", rows)
    # parquet wants one schema: every message has a thinking field (null where absent)
    flat = [{"messages": [{**m, "thinking": m.get("thinking")} for m in r["messages"]]} for r in rows]
    ds = datasets.Dataset.from_list(flat)
    ds.to_parquet(str(tmp_path / "chat.parquet"))
    cfg = MessagesConfig()
    layout = _cfg([jsonl]).layout
    sources = [build_source(_cfg([jsonl]), tok), build_source(_cfg([tmp_path / "chat.parquet"]), tok),
               MessagesSource(dataset=ds, tokenizer=tok, config=cfg, layout=layout)]
    for src in sources:
        assert len(src) == 4  # 3 + 1 assistant turns: each one an example
        for name in ("prompt_ids", "prompt_offsets", "response_ids", "response_offsets"):
            np.testing.assert_array_equal(getattr(src.encoded_rows, name), getattr(sources[0].encoded_rows, name))
    assert sources[0].location(3) == f"{jsonl}:2" and sources[1].location(3).endswith("chat.parquet: record 2")
    assert sources[2].location(0) == "dataset row 0"
    ex = sources[0][1]
    assert ex.prompt.startswith("<bos><|turn>system\n<|think|>You are terse.") and ex.prompt.endswith("<|turn>model\n")
    assert ex.answer == ex.response == "<|channel>thought\nDouble it.<channel|>2 * 42 = 84\n#### 84"
    last = MessagesSource(dataset=ds, tokenizer=tok, config=MessagesConfig(turns="last"), layout=layout)
    assert [last[i].response for i in range(len(last))] == ["You're welcome.", "Hello."]


def test_pipeline_rows_end_on_end_of_turn_and_only_answers_are_targets(tmp_path, tok):
    jsonl = _write_jsonl(tmp_path / "c.jsonl", [{"messages": THREE_TURNS}])
    pipe = DataPipeline(_cfg([jsonl]), tokenizer=tok, process_index=0, process_count=1)
    batch = pipe.batch(0)
    src = pipe.source
    P = 128
    for row in range(2):
        context, target = src.encoded_rows.prompt(row), src.encoded_rows.response(row)
        n = int(batch["response_length"][row])
        assert n == len(target) + 1 and batch["prompt_length"][row] == len(context)  # nothing truncated
        np.testing.assert_array_equal(batch["tokens"][row, P - len(context):P], context)
        np.testing.assert_array_equal(batch["tokens"][row, P:P + n], [*target, tok.eos_id])
        assert batch["tokens"][row, P - len(context)] == tok.bos_id  # the template's BOS, not a second one
        # AR targets: the answer and its <turn|>, never the context
        weighted = batch["ar_targets"][row][batch["ar_weight"][row] > 0]
        np.testing.assert_array_equal(weighted, [*target, tok.eos_id])
        assert not batch["diffusion_weight"][row][n:].any() or batch["tokens"][row, P + n] == tok.eos_id


def test_gsm8k_reward_on_chat_rows(tmp_path, tok):
    jsonl = _write_jsonl(tmp_path / "g.jsonl", [{"messages": THREE_TURNS[1:5]}])
    src = build_source(_cfg([jsonl], messages={"reward": "gsm8k", "thinking": "drop"}), tok)
    ex = src[1]
    assert ex.task == "gsm8k" and ex.answer == "84"
    good = src.encoded_rows.response(1).tolist() + [tok.eos_id, 7, 7]
    assert reward(ex, good, tok) == 1.0
    assert reward(ex, tok.encode("2 * 42 = 85\n#### 85") + [tok.eos_id], tok) == 0.0
    assert reward(ex, tok.encode("#### 84"), tok, require_eos=True) == 0.0  # never ended its turn
    assert reward(ex, "2 * 42 = 84\n#### 84<turn|>junk", tok) == 1.0  # text is cut at the end of turn
    bad = _write_jsonl(tmp_path / "nohash.jsonl", [{"messages": [{"role": "user", "content": "Hi"},
                                                                 {"role": "assistant", "content": "Hello."}]}])
    with pytest.raises(ValueError, match=r"nohash.jsonl:1: the assistant turn at message 1 has no '####'"):
        build_source(_cfg([bad], messages={"reward": "gsm8k"}), tok)


BAD_ROWS = [
    ({"text": "no messages here"}, "no 'messages'"),
    ({"messages": []}, "no 'messages'"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "robot", "content": "Beep."}]},
     "message 1: unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "x"}]},
     "message 0 \\(user\\): content must be text, got list"),
    ({"messages": [{"role": "user", "content": "Hi"}]}, "no assistant turn"),
    ({"messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]},
     "the context of the assistant turn at message 1 has \\d+ tokens > data.layout.prompt_len=128"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "word " * 200}]},
     "the assistant turn at message 1 has \\d+ tokens incl. <turn\\|> > data.layout.n_blocks x canvas_length = 128"),
    ('{"messages": [', "not a JSON object"),
]
GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}


@pytest.mark.parametrize("bad,reason", BAD_ROWS)
def test_malformed_rows_are_refused_or_skipped_naming_file_and_line(tmp_path, tok, bad, reason, caplog):
    path = _write_jsonl(tmp_path / "rows.jsonl", [GOOD, "", bad, GOOD])  # the bad row is on line 3
    with pytest.raises(ValueError, match=f"^{tmp_path}/rows.jsonl:3: {reason}.*\\(1 of 3 rows are bad\\)"):
        build_source(_cfg([path]), tok)
    with caplog.at_level(logging.WARNING, logger="dgemma.data.messages"):
        src = build_source(_cfg([path], messages={"bad_rows": "skip"}), tok)
    assert len(src) == 2 and [src.location(i) for i in range(2)] == [f"{path}:1", f"{path}:4"]
    assert len(src.skipped) == 1 and src.skipped[0].startswith(f"{path}:3: ")
    assert f"{path}:3" in caplog.text


def test_malformed_rows_of_a_parquet_file_name_the_record(tmp_path, tok):
    import datasets

    datasets.Dataset.from_list([GOOD, {"messages": [{"role": "user", "content": "Hi"}]}]).to_parquet(
        str(tmp_path / "p.parquet"))
    with pytest.raises(ValueError, match=r"p.parquet: record 2: no assistant turn"):
        build_source(_cfg([tmp_path / "p.parquet"]), tok)
    only_bad = _write_jsonl(tmp_path / "bad.jsonl", [{"messages": []}])
    with pytest.raises(ValueError, match=r"no usable chat rows .*bad.jsonl:1: no 'messages'"):
        build_source(_cfg([only_bad], messages={"bad_rows": "skip"}), tok)


def test_check_messages_refuses_misplaced_system_and_thinking():
    with pytest.raises(BadRow, match="a system message must come first"):
        check_messages({"messages": [{"role": "user", "content": "a"}, SYSTEM]})
    with pytest.raises(BadRow, match="'thinking' must be text on an assistant message"):
        check_messages({"messages": [{"role": "user", "content": "a", "thinking": "b"}]})


def test_config_refuses_chat_data_without_a_chat_tokenizer():
    with pytest.raises(ValueError, match="DataConfig.tokenizer: source='messages'"):
        DataConfig(source="messages", paths=("x.jsonl",), add_bos=False, tokenizer={"kind": "hf", "path": "t"})
    with pytest.raises(ValueError, match="DataConfig.add_bos: source='messages'"):
        DataConfig(source="messages", paths=("x.jsonl",), tokenizer=TOK_CFG)
    with pytest.raises(ValueError, match="DataConfig.tokenizer.chat"):
        DataConfig(source="json", paths=("x.jsonl",), tokenizer=TOK_CFG)
    with pytest.raises(ValueError, match="TokenizerConfig.chat: applies to kind='hf' only"):
        TokenizerConfig(kind="toy", chat=True)
    with pytest.raises(ValueError, match="TokenizerConfig.eos_id"):
        TokenizerConfig(kind="hf", path="t", chat=True, eos_id=1)
    with pytest.raises(ValueError, match="MessagesConfig.bad_rows"):
        MessagesConfig(bad_rows="ignore")
    assert build_tokenizer(TokenizerConfig(**TOK_CFG)).stop_ids == (6, 1)


def test_sample_renders_a_free_text_prompt_as_a_user_turn(tok):
    from dgemma.cli.sample import encode_prompts

    prompts, valid = encode_prompts(tok, ["What is 2+2?", "Hi"], add_bos=False)
    rendered = tok.decode(prompts[0][valid[0]])
    assert rendered == "<bos><|turn>user\nWhat is 2+2?<turn|>\n<|turn>model\n"
    assert tok.decode(prompts[1][valid[1]]) == "<bos><|turn>user\nHi<turn|>\n<|turn>model\n"
    assert (prompts[1][~valid[1]] == tok.pad_id).all()
