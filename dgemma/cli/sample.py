"""`dgemma sample`: generate with a trained model: block diffusion, AR fallback, or auto.

    dgemma sample -c experiments/tiny_pipeline/stage1.yaml --checkpoint runs/tiny_pipeline/stage1/params \\
        --prompt "C1234567|" --prompt "S9381|" --mode diffusion sampler.max_steps=16

Prompts are tokenized with the config's tokenizer (`data.tokenizer`), a BOS is prepended when `data.add_bos`, and the
batch is left-padded. Sampler settings come from the config's `sampler` section (override with `sampler.*=...`);
each committed block is printed as it arrives, then the decoded outputs and per-row metrics (tokens per forward,
steps per block, stop reasons).
"""

from __future__ import annotations

import argparse
import sys

from dgemma.cli import common

NAME = "sample"
HELP = "generate with a checkpoint (diffusion | ar | auto)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `dgemma sample` besides the shared config ones."""
    parser.add_argument("--checkpoint", metavar="PATH", required=True, help="params-only checkpoint")
    parser.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="prompt (repeatable)")
    parser.add_argument("--prompt-file", metavar="FILE", help="one prompt per line")
    parser.add_argument("--mode", choices=("diffusion", "ar", "auto"), default=None,
                        help="decoding mode (default: sampler.mode)")
    parser.add_argument("--seed", type=int, default=0)


def encode_prompts(tokenizer, texts: list[str], add_bos: bool):
    import numpy as np

    if getattr(tokenizer, "chat", False):  # a chat model is asked in a user turn, rendered by its chat template
        from dgemma.data.chat import chat_prompt_ids

        rows = [chat_prompt_ids(tokenizer.hf_tokenizer, t) for t in texts]
    else:
        rows = [([tokenizer.bos_id] if add_bos else []) + list(tokenizer.encode(t)) for t in texts]
    P = max(len(r) for r in rows)
    prompts = np.full((len(rows), P), tokenizer.pad_id, np.int32)
    valid = np.zeros((len(rows), P), bool)
    for i, r in enumerate(rows):
        prompts[i, P - len(r):] = r
        valid[i, P - len(r):] = True
    return prompts, valid


def decode_shown(tokenizer, ids: list[int]) -> str:
    """The text of sampled `ids`; an id the tokenizer cannot decode shows as `<id N>` instead of failing the command:
    a model's vocabulary may be larger than its tokenizer's (the rehearsal's 128 over the toy tokenizer's ids), and
    an untrained model samples anywhere in it."""
    try:
        return tokenizer.decode(ids)
    except ValueError:
        pieces = []
        for i in ids:
            try:
                pieces.append(tokenizer.decode([i]))
            except ValueError:
                pieces.append(f"<id {i}>")
        return "".join(pieces)


def run(args: argparse.Namespace) -> int:
    cfg, done = common.load_or_print(args)
    if done:
        return common.EXIT_OK
    common.check_decodable(cfg.diffusion, [args.mode or cfg.sampler.mode])
    blank = [i for i, t in enumerate(args.prompt, 1) if not t.strip()]
    if blank:  # a model asked to continue nothing decodes from BOS alone: surely not what was meant
        print(f"dgemma sample: --prompt number {blank[0]} is empty or whitespace only; give the text to continue",
              file=sys.stderr)
        return common.EXIT_USAGE
    texts = list(args.prompt)
    if args.prompt_file:
        with open(args.prompt_file) as f:
            texts += [ln.rstrip("\n") for ln in f if ln.strip()]
    if not texts:
        print("dgemma sample: give --prompt TEXT (repeatable) or --prompt-file FILE", file=sys.stderr)
        return common.EXIT_USAGE
    import jax

    from dgemma.data.tokenizer import build_tokenizer
    from dgemma.inference.metrics import format_summary, summarize
    from dgemma.inference.sampler import SamplerConfig, sample

    tokenizer = build_tokenizer(cfg.data.tokenizer)
    try:
        prompts, valid = encode_prompts(tokenizer, texts, cfg.data.add_bos)
    except ValueError as e:  # a character outside the vocabulary
        raise common.CommandError(f"prompt: {e}") from None
    mcfg = cfg.model_config
    L = mcfg.canvas_length
    need = prompts.shape[1] + -(-cfg.sampler.max_new_tokens // L) * L  # the budget is rounded up to whole canvases
    if need > mcfg.max_position_embeddings:
        raise common.CommandError(f"prompt of {prompts.shape[1]} tokens + sampler.max_new_tokens="
                                  f"{cfg.sampler.max_new_tokens} (rounded to canvases of {L}) = {need} positions > "
                                  f"model.max_position_embeddings={mcfg.max_position_embeddings}")
    model, _ = common.restore_model(cfg, args.checkpoint, sampling=True)
    mode = {"mode": args.mode} if args.mode else {}  # --mode overrides sampler.mode
    scfg = SamplerConfig.from_section(cfg.sampler, eos_ids=tuple(tokenizer.stop_ids), pad_id=tokenizer.pad_id, **mode)

    def on_block(b, tokens):
        print(f"[block {b}] " + " | ".join(decode_shown(tokenizer, [int(t) for t in row]) for row in tokens),
              flush=True)

    # on the run's mesh, like the params: the prompts split over its batch axes (not every device decoding them all)
    res = sample(model, prompts, valid, scfg, jax.random.key(args.seed), scfg.mode, on_block=on_block,
                 mesh=common.run_mesh(cfg.mesh), rules=cfg.mesh.rules)
    for text, row, tpf in zip(texts, res.tokens, res.tpf):
        out = decode_shown(tokenizer, [int(t) for t in row if int(t) != tokenizer.pad_id])
        print(f"{text!r} -> {out!r}  (tokens/forward {tpf:.2f})")
    print(format_summary(summarize(res, scfg.max_steps)))
    return common.EXIT_OK


if __name__ == "__main__":
    sys.exit(common.standalone(sys.modules[__name__]))
