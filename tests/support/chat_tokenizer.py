"""A tiny Hugging Face tokenizer with Gemma 4's chat format, built offline with the `tokenizers` library.

Word-level over exactly `vocab_size` tokens (so every id a tiny model generates decodes): Gemma's special ids
PAD 0, EOS 1, BOS 2, then UNK, the turn tokens `<|turn>` / `<turn|>`, the role names and filler words. The chat
template writes Gemma 4's turns (`<|turn>user\\n...<turn|>\\n`, generation prompt `<|turn>model\\n`).
"""

from __future__ import annotations

from pathlib import Path

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>"]
WORDS = ["user", "model", "system", "hello", "why", "is", "the", "sky", "blue", "?", "."]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")


def build(directory, vocab_size: int = 128) -> Path:
    """Save the tokenizer (tokenizer.json, tokenizer_config.json with the chat template) to `directory`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + WORDS + [f"w{i}" for i in range(vocab_size - len(SPECIALS) - len(WORDS))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Punctuation()])
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                 unk_token="<unk>", additional_special_tokens=["<|turn>", "<turn|>"])
    hf.chat_template = CHAT_TEMPLATE
    directory = Path(directory)
    hf.save_pretrained(directory)
    return directory
