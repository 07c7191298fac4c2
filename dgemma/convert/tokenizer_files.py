"""The tokenizer an export carries: which files are copied, and the stop / pad ids generation_config.json takes from it.

An export serves chat only with the tokenizer and chat template the model was trained with: `copy_tokenizer` copies a
Hugging Face tokenizer directory's files (tokenizer.json, tokenizer_config.json, special_tokens_map.json,
chat_template.jinja, ...) beside the weights. `special_ids` reads the ids `generate` needs from it: EOS is the
tokenizer's EOS plus Gemma's end-of-turn `<turn|>` when the vocabulary has it (a chat answer ends with `<turn|>`, not
`<eos>`), PAD the tokenizer's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_PREFIXES = ("tokenizer", "special_tokens", "chat_template", "added_tokens")
END_OF_TURN = "<turn|>"


def tokenizer_files(tokenizer_dir) -> list[Path]:
    """The files of `tokenizer_dir` an export copies; a directory with no tokenizer file is refused (one line)."""
    d = Path(tokenizer_dir)
    if not d.is_dir():
        raise ValueError(f"tokenizer directory {d} does not exist")
    files = [f for f in sorted(d.iterdir()) if f.is_file() and f.name.startswith(TOKENIZER_PREFIXES)]
    if not any(f.name.startswith("tokenizer") for f in files):
        raise ValueError(f"tokenizer directory {d}: no tokenizer.json / tokenizer_config.json (not a Hugging Face "
                         f"tokenizer directory)")
    return files


def copy_tokenizer(tokenizer_dir, dest: Path) -> None:
    for f in tokenizer_files(tokenizer_dir):
        shutil.copyfile(f, dest / f.name)


def load(tokenizer_dir):
    """transformers' tokenizer of `tokenizer_dir`, local files only (a missing file is an error, never a download)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer directory {tokenizer_dir}: transformers cannot load it ({e})") from None


def has_chat_template(tokenizer_dir) -> bool:
    return bool(getattr(load(tokenizer_dir), "chat_template", None))


def special_ids(tokenizer_dir) -> dict:
    """{"eos": [ids], "pad": id | None} of the tokenizer: its EOS, then `<turn|>` when the vocabulary has it."""
    tok = load(tokenizer_dir)
    eos = [] if tok.eos_token_id is None else [int(tok.eos_token_id)]
    turn = tok.get_vocab().get(END_OF_TURN)
    if turn is not None and int(turn) not in eos:
        eos.append(int(turn))
    return {"eos": eos, "pad": None if tok.pad_token_id is None else int(tok.pad_token_id)}
