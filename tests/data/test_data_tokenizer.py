"""Tokenizers: the hermetic toy vocabulary and the local HF AutoTokenizer wrapper."""

import numpy as np
import pytest

from dgemma.data.config import TokenizerConfig
from dgemma.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, HFTokenizer, Tokenizer, ToyTokenizer, build_tokenizer


def test_toy_special_ids_match_gemma():
    tok = ToyTokenizer()
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2) == (PAD_ID, EOS_ID, BOS_ID)
    assert tok.vocab_size == 32
    assert tok.decode([0, 1, 2]) == "<pad><eos><bos>"
    assert isinstance(tok, Tokenizer)


def test_toy_round_trip_and_layout():
    tok = ToyTokenizer()
    text = "A52+89|341"
    ids = tok.encode(text)
    assert len(ids) == len(text)  # character level
    assert tok.decode(ids) == text
    assert tok.encode("0123456789") == list(range(6, 16))
    assert tok.encode("|+*") == [3, 4, 5]
    # special markers parse as single tokens, and skip_special_tokens drops them
    assert tok.encode("12<eos><pad>") == [7, 8, EOS_ID, PAD_ID]
    assert tok.decode([BOS_ID, 7, 8, EOS_ID, PAD_ID], skip_special_tokens=True) == "12"
    assert tok.decode(np.array([[7], [8]])) == "12"


def test_toy_reserved_ids_are_never_produced_by_data():
    tok = ToyTokenizer()
    reserved = set(tok.reserved_ids)
    assert len(reserved) == 8 and max(reserved) == tok.vocab_size - 1
    every_symbol = "".join(s for s in tok.vocab if not s.startswith("<"))
    assert reserved.isdisjoint(tok.encode(every_symbol))


def test_toy_paper_vocab_is_24():
    tok = ToyTokenizer("0123456789+|CSAP", num_reserved=5)
    assert tok.vocab_size == 24
    assert tok.encode("C12|") == [3 + 12, 3 + 1, 3 + 2, 3 + 11]


def test_toy_word_level_longest_match():
    tok = ToyTokenizer(("a", "ab", "abc", "####"), num_reserved=0)
    assert tok.decode(tok.encode("abcab####a")) == "abcab####a"
    assert len(tok.encode("abcab####a")) == 4


def test_toy_errors():
    tok = ToyTokenizer()
    with pytest.raises(ValueError, match=r"'x' at offset 2"):
        tok.encode("12x")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([99])
    with pytest.raises(ValueError, match="unique"):
        ToyTokenizer(("1", "1"))
    with pytest.raises(ValueError, match="clash"):
        ToyTokenizer(("<eos>",))


def _save_tiny_hf_tokenizer(path, with_pad=True):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = ["the", "cat", "sat", "on", "mat", "####", "1", "2", "3", "|"]
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(words)}}
    if not with_pad:
        vocab.pop("<pad>")
        vocab = {w: i for i, w in enumerate(vocab)}
    model = tokenizers.models.WordLevel(vocab, unk_token="<unk>")
    tk = tokenizers.Tokenizer(model)
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    special = dict(eos_token="<eos>", bos_token="<bos>", unk_token="<unk>")
    if with_pad:
        special["pad_token"] = "<pad>"
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, **special)
    fast.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return _save_tiny_hf_tokenizer(tmp_path_factory.mktemp("hf_tok"))


def test_hf_wrapper_round_trip(hf_dir):
    tok = HFTokenizer(str(hf_dir))
    assert isinstance(tok, Tokenizer)
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
    assert tok.vocab_size == 14
    ids = tok.encode("the cat sat on the mat")
    assert ids == [4, 5, 6, 7, 4, 8]  # no BOS/EOS added by encode
    assert tok.decode(ids) == "the cat sat on the mat"
    assert tok.decode([4, 5, tok.eos_id, 0], skip_special_tokens=True) == "the cat"
    assert tok.eos_token == "<eos>"
    assert tok.stop_ids == (1,)


def test_hf_wrapper_via_config_and_overrides(hf_dir):
    tok = build_tokenizer(TokenizerConfig(kind="hf", path=str(hf_dir), extra_stop_ids=(9,)))
    assert isinstance(tok, HFTokenizer)
    assert tok.stop_ids == (1, 9)
    tok2 = HFTokenizer(str(hf_dir), eos_id=13)
    assert tok2.eos_id == 13 and tok2.stop_ids == (13,)


def test_hf_wrapper_missing_pad_is_a_clear_error(tmp_path):
    path = _save_tiny_hf_tokenizer(tmp_path / "nopad", with_pad=False)
    with pytest.raises(ValueError, match="no pad token"):
        HFTokenizer(str(path))
    assert HFTokenizer(str(path), pad_id=3).pad_id == 3


def test_hf_wrapper_never_downloads(tmp_path):
    with pytest.raises(Exception):
        HFTokenizer(str(tmp_path / "does-not-exist"))


def test_tokenizer_config_validation():
    with pytest.raises(ValueError, match="TokenizerConfig.path"):
        TokenizerConfig(kind="hf")
    with pytest.raises(ValueError, match="TokenizerConfig.kind"):
        TokenizerConfig(kind="sentencepiece")
    assert build_tokenizer(TokenizerConfig(symbols=list("0123456789+|CSAP"), num_reserved=5)).vocab_size == 24
