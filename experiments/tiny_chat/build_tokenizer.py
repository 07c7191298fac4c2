"""Builds the tiny-chat tokenizer shipped at dgemma/data/tokenizers/tiny_chat/ (deterministically).

    python experiments/tiny_chat/build_tokenizer.py                       # rebuild the shipped directory
    python experiments/tiny_chat/build_tokenizer.py --out /tmp/tok         # elsewhere

A byte-level BPE (HF `tokenizers`) of VOCAB_SIZE ids, digits split one per token (as Gemma's tokenizer does, which
keeps arithmetic learnable for a tiny model), Gemma 4's control tokens as special tokens at the front (PAD 0, EOS 1,
BOS 2, as Gemma), and the Gemma-4-format chat template of chat_template.jinja as the tokenizer's `chat_template`.
Saved with `PreTrainedTokenizerFast.save_pretrained`, so `AutoTokenizer.from_pretrained(DIR)` loads it.

Corpus (offline, see the tokenizer's README.md for why): the GSM8K *train* rows (dgemma.data.gsm8k_chat's split;
the held-out rows never shape the vocabulary), each as question + answer, then the docstrings of STDLIB_MODULES
read from the installed standard library's sources (not imported). MANIFEST.json records the corpus's sha256, the
Python version whose standard library was read and the sha256 of every file written, so a rebuild can be checked.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import platform
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SHIPPED = REPO / "dgemma/data/tokenizers/tiny_chat"
# shared/ lies next to the repository (CI) or next to the folder of worktrees holding it
GSM8K = next((p for p in (REPO.parent / "shared/data/gsm8k/test.jsonl", REPO.parents[1] / "shared/data/gsm8k/test.jsonl")
              if p.exists()), REPO.parent / "shared/data/gsm8k/test.jsonl")
TEMPLATE = HERE / "chat_template.jinja"
VOCAB_SIZE = 4096
# Gemma 4's control tokens (Gemma 4's prompt-formatting docs; docs/chat_data.md), PAD / EOS / BOS first so that their ids are Gemma's.
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>",
                  "<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>",
                  "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>',
                  "<|image>", "<image|>", "<|audio>", "<audio|>", "<|image|>", "<|audio|>")
# English prose about programs and numbers; fixed so the corpus is the same on every machine with this Python.
STDLIB_MODULES = ("abc", "argparse", "bisect", "calendar", "collections/__init__", "contextlib", "csv", "dataclasses",
                  "datetime", "decimal", "difflib", "enum", "fractions", "functools", "heapq", "inspect",
                  "json/__init__", "logging/__init__", "numbers", "pathlib/__init__", "pathlib", "random", "shutil",
                  "statistics", "string", "textwrap", "threading", "typing", "unittest/case", "zipfile/__init__",
                  "zipfile")
MANIFEST = "MANIFEST.json"


def gsm8k_train_texts(path: Path = GSM8K) -> list[str]:
    from dgemma.data.gsm8k_chat import read_gsm8k, split_rows

    return [f"{row['question']}\n{row['answer']}" for _, row in split_rows(read_gsm8k(str(path)), "train")]


def stdlib_docstrings(modules=STDLIB_MODULES) -> list[str]:
    """The docstrings of the module, its classes and functions, in `ast.walk` order, of each module that exists in
    this Python's standard library (a module moved to a package in another version is listed both ways)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for name in modules:
        path = root / f"{name}.py"
        if not path.is_file():
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    texts.append(doc)
    return texts


def corpus(gsm8k_path: Path = GSM8K) -> list[str]:
    return gsm8k_train_texts(gsm8k_path) + stdlib_docstrings()


def build(texts: list[str], out_dir: Path, vocab_size: int = VOCAB_SIZE) -> dict:
    """Trains the tokenizer on `texts`, saves it in HF form under `out_dir` with MANIFEST.json; returns the manifest."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>", mask_token="<mask>",
                                   additional_special_tokens=list(SPECIAL_TOKENS[5:]))
    fast.chat_template = TEMPLATE.read_text(encoding="utf-8")
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    files = sorted(p.name for p in out_dir.iterdir() if p.name not in (MANIFEST, "README.md"))
    manifest = {
        "vocab_size": len(fast),
        "corpus_sha256": hashlib.sha256("\x00".join(texts).encode()).hexdigest(),
        "corpus_texts": len(texts),
        "python": platform.python_version(),
        "files": {name: hashlib.sha256((out_dir / name).read_bytes()).hexdigest() for name in files},
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return manifest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=SHIPPED, help=f"output directory (default {SHIPPED})")
    p.add_argument("--gsm8k", type=Path, default=GSM8K, help="GSM8K jsonl (the split is taken from it)")
    args = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    manifest = build(corpus(args.gsm8k), args.out)
    print(json.dumps(manifest, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
