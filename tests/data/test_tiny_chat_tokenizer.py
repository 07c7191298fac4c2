"""The shipped tiny-chat tokenizer: its files are what the deterministic builder writes (MANIFEST.json), it loads with
`AutoTokenizer`, carries Gemma 4's control tokens at Gemma's PAD / EOS / BOS ids, renders chat; the GSM8K train /
held-out split it was trained on, and the GSM8K chat data writer."""

import hashlib
import json
import tomllib
from pathlib import Path

import pytest

from dgemma.data.gsm8k_chat import chat_row, is_held_out, read_gsm8k, split_rows, write_gsm8k_chat
from support.scripts import REPO, load_script

SHIPPED = REPO / "dgemma/data/tokenizers/tiny_chat"
builder = load_script("experiments/tiny_chat/build_tokenizer.py", "build_tokenizer")
needs_gsm8k = pytest.mark.skipif(not builder.GSM8K.exists(),
                                 reason=f"GSM8K not found at {builder.GSM8K} (shared/ next to the repo)")


def _manifest(directory: Path) -> dict:
    return json.loads((directory / builder.MANIFEST).read_text())


def test_shipped_files_are_the_manifests():
    manifest = _manifest(SHIPPED)
    assert manifest["vocab_size"] == builder.VOCAB_SIZE == 4096
    assert sorted(manifest["files"]) == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((SHIPPED / name).read_bytes()).hexdigest() == digest, name
    assert (SHIPPED / "chat_template.jinja").read_text() == builder.TEMPLATE.read_text()


def test_tokenizer_is_package_data():
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "tokenizers/tiny_chat/*" in data["dgemma.data"]


def test_autotokenizer_loads_it_with_gemma_ids_and_its_chat_template():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(SHIPPED), local_files_only=True)
    assert len(tok) == 4096
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    assert tok.convert_tokens_to_ids(list(builder.SPECIAL_TOKENS)) == list(range(len(builder.SPECIAL_TOKENS)))
    for special in builder.SPECIAL_TOKENS:  # each control token is one id, in text too
        assert tok.encode(f"a{special}b", add_special_tokens=False)[1:-1] == [tok.convert_tokens_to_ids(special)]
    assert tok.encode("1234", add_special_tokens=False) == [tok.convert_tokens_to_ids(d) for d in "1234"]
    text = "Weng earns $12 an hour for babysitting. ½ ünïcode €"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "A", "thinking": "T"}]
    assert tok.apply_chat_template(msgs, tokenize=False, enable_thinking=True) == (
        "<bos><|turn>system\n<|think|>S<turn|>\n<|turn>user\nQ<turn|>\n"
        "<|turn>model\n<|channel>thought\nT<channel|>A<turn|>\n")
    assert tok.apply_chat_template(msgs[1:2], tokenize=False, add_generation_prompt=True) == (
        "<bos><|turn>user\nQ<turn|>\n<|turn>model\n")


def test_builder_is_deterministic_on_a_small_corpus(tmp_path):
    texts = builder.stdlib_docstrings(("textwrap", "string", "bisect"))  # the full corpus is tested below
    a, b = builder.build(texts, tmp_path / "a", vocab_size=400), builder.build(texts, tmp_path / "b", vocab_size=400)
    assert a == b and a["vocab_size"] == 400
    for name in a["files"]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


@needs_gsm8k
def test_rebuilding_gives_the_shipped_files(tmp_path):
    texts = builder.corpus()
    shipped = _manifest(SHIPPED)
    corpus_sha = hashlib.sha256("\x00".join(texts).encode()).hexdigest()
    if corpus_sha != shipped["corpus_sha256"]:
        pytest.skip(f"this Python's standard library differs from {shipped['python']}'s, whose docstrings the "
                    "shipped tokenizer was trained on")
    assert builder.build(texts, tmp_path / "t") == shipped


@needs_gsm8k
def test_gsm8k_split_is_fixed_and_the_tokenizer_never_saw_held_out_rows(tmp_path):
    rows = read_gsm8k(str(builder.GSM8K))
    train, held = [i for i, _ in split_rows(rows, "train")], [i for i, _ in split_rows(rows, "heldout")]
    assert (len(train), len(held)) == (1057, 262) and not set(train) & set(held)
    assert held[:5] == [i for i in range(len(rows)) if is_held_out(i)][:5]
    corpus = builder.gsm8k_train_texts()
    assert len(corpus) == 1057
    held_questions = {rows[i]["question"] for i in held}
    assert not any(t.split("\n", 1)[0] in held_questions for t in corpus)
    paths = write_gsm8k_chat(str(builder.GSM8K), str(tmp_path / "a"))
    again = write_gsm8k_chat(str(builder.GSM8K), str(tmp_path / "b"))
    for split in ("train", "heldout"):
        assert Path(paths[split]).read_bytes() == Path(again[split]).read_bytes()
    first = json.loads(Path(paths["heldout"]).read_text().splitlines()[0])
    assert first == chat_row(rows[held[0]], held[0])
    assert first["messages"][1]["content"].rsplit("####", 1)[1].strip()  # ends with the final answer


def test_read_gsm8k_names_the_bad_line(tmp_path):
    bad = tmp_path / "g.jsonl"
    bad.write_text('{"question": "q", "answer": "a\\n#### 1"}\n{"question": "q", "answer": "no final"}\n')
    with pytest.raises(ValueError, match=r"g.jsonl:2: GSM8K answer has no '####'"):
        read_gsm8k(str(bad))
