"""`dgemma sample`: generate with a trained model: block diffusion, AR fallback, or auto.

    dgemma sample -c experiments/tiny_pipeline/stage1.yaml --checkpoint runs/tiny_pipeline/stage1/params \\
        --prompt "C1234567|" --prompt "S9381|" --mode diffusion sampler.max_steps=16
    dgemma sample -c configs/chat/tiny.yaml --checkpoint runs/chat_tiny/params --prompt "What is 12 + 30?"
    dgemma sample -c configs/chat/tiny.yaml --checkpoint runs/chat_tiny/params --messages conversation.json

Prompts are tokenized with the config's tokenizer (`data.tokenizer`), a BOS is prepended when `data.add_bos`, and the
batch is left-padded. With a chat tokenizer (`data.tokenizer.chat: true`) a `--prompt` is one user turn rendered by
the chat template (`--raw`: the text as it is, control tokens written by hand), and `--messages FILE` is one
conversation (a JSON object `{"messages": [...]}` or a bare list, ending on a user turn). Sampler settings come from
the config's `sampler` section (override with `sampler.*=...`). Each committed block is printed as it arrives: with
a text tokenizer (`kind: hf`) as the answer's new text, decoded whole so that no character is broken, up to the end
of the turn; then the stop reason and the per-row metrics (tokens per forward, steps per block, stop reasons).
"""

from __future__ import annotations

import argparse
import sys

from dgemma.cli import common
from dgemma.cli.answers import TextStream, decode_shown, stop_reason

NAME = "sample"
HELP = "generate with a checkpoint (diffusion | ar | auto)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `dgemma sample` besides the shared config ones."""
    parser.add_argument("--checkpoint", metavar="PATH", required=True, help="params-only checkpoint")
    parser.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="prompt (repeatable)")
    parser.add_argument("--prompt-file", metavar="FILE", help="one prompt per line")
    parser.add_argument("--messages", metavar="FILE", help="a chat config: one conversation ending on a user turn "
                        "(JSON: {\"messages\": [...]} or a list of {\"role\", \"content\"})")
    parser.add_argument("--raw", action="store_true",
                        help="a chat config: send the prompt text as it is, without the chat template")
    parser.add_argument("--mode", choices=("diffusion", "ar", "auto"), default=None,
                        help="decoding mode (default: sampler.mode)")
    parser.add_argument("--seed", type=int, default=0)


def encode_prompts(tokenizer, texts: list[str], add_bos: bool, *, raw: bool = False):
    """Left-padded prompt ids [rows, P] and their valid mask: a chat tokenizer's prompt as one user turn through its
    chat template (unless `raw`), any other the text's ids (after BOS when `add_bos`)."""
    if getattr(tokenizer, "chat", False) and not raw:  # a chat model is asked in a user turn
        from dgemma.data.chat import chat_prompt_ids

        rows = [chat_prompt_ids(tokenizer.hf_tokenizer, t) for t in texts]
    else:
        rows = [([tokenizer.bos_id] if add_bos else []) + list(tokenizer.encode(t)) for t in texts]
    return left_padded(rows, tokenizer.pad_id)


def left_padded(rows: list[list[int]], pad_id: int):
    import numpy as np

    P = max(len(r) for r in rows)
    prompts = np.full((len(rows), P), pad_id, np.int32)
    valid = np.zeros((len(rows), P), bool)
    for i, r in enumerate(rows):
        prompts[i, P - len(r):] = r
        valid[i, P - len(r):] = True
    return prompts, valid


def _prompt_rows(args, cfg, tokenizer):
    """(what each row answers, in words; left-padded prompt ids; valid mask) from --prompt / --prompt-file /
    --messages."""
    if args.messages:
        from dgemma.data.chat import conversation_prompt_ids, read_conversation

        try:
            messages = read_conversation(args.messages, cfg.data.messages.field)
        except ValueError as e:
            raise common.CommandError(f"--messages {e}") from None
        ids = conversation_prompt_ids(tokenizer.hf_tokenizer, messages, thinking=cfg.data.messages.thinking)
        return [f"{args.messages} ({len(messages)} messages)"], *left_padded([ids], tokenizer.pad_id)
    texts = list(args.prompt)
    if args.prompt_file:
        with open(args.prompt_file) as f:
            texts += [ln.rstrip("\n") for ln in f if ln.strip()]
    if not texts:
        raise common.CommandError("give --prompt TEXT (repeatable), --prompt-file FILE or --messages FILE")
    try:
        return texts, *encode_prompts(tokenizer, texts, cfg.data.add_bos, raw=args.raw)
    except ValueError as e:  # a character outside the vocabulary
        raise common.CommandError(f"prompt: {e}") from None


def _check_inputs(args, cfg) -> None:
    """Refuse contradictory prompt flags and chat flags without a chat tokenizer, before anything is loaded."""
    blank = [i for i, t in enumerate(args.prompt, 1) if not t.strip()]
    if blank:  # a model asked to continue nothing decodes from BOS alone: surely not what was meant
        raise common.CommandError(f"--prompt number {blank[0]} is empty or whitespace only; give the text to continue")
    if args.messages and (args.prompt or args.prompt_file):
        raise common.CommandError("--messages FILE is the whole conversation; give it or --prompt / --prompt-file, "
                                  "not both")
    if args.messages and args.raw:
        raise common.CommandError("--raw sends prompt text without the chat template; --messages is always rendered "
                                  "by it")
    tok = cfg.data.tokenizer
    if args.messages and not tok.chat:
        raise common.CommandError(f"--messages {args.messages}: needs a chat tokenizer (data.tokenizer.chat: true, "
                                  f"a tokenizer with a chat template); this config's is kind={tok.kind!r}"
                                  f"{'' if tok.kind == 'toy' else ', chat: false'}")


def run(args: argparse.Namespace) -> int:
    cfg, done = common.load_or_print(args)
    if done:
        return common.EXIT_OK
    common.check_decodable(cfg.diffusion, [args.mode or cfg.sampler.mode])
    _check_inputs(args, cfg)
    import jax

    from dgemma.inference.metrics import format_summary, summarize
    from dgemma.inference.sampler import SamplerConfig, sample

    tokenizer = common.build_tokenizer(cfg)
    texts, prompts, valid = _prompt_rows(args, cfg, tokenizer)
    mcfg = cfg.model_config
    L = mcfg.canvas_length
    need = prompts.shape[1] + -(-cfg.sampler.max_new_tokens // L) * L  # the token budget is rounded up to whole blocks
    if need > mcfg.max_position_embeddings:
        raise common.CommandError(f"prompt of {prompts.shape[1]} tokens + sampler.max_new_tokens="
                                  f"{cfg.sampler.max_new_tokens} (rounded to canvases of {L}) = {need} positions > "
                                  f"model.max_position_embeddings={mcfg.max_position_embeddings}")
    model, _ = common.restore_model(cfg, args.checkpoint, sampling=True)
    mode = {"mode": args.mode} if args.mode else {}  # --mode overrides sampler.mode
    scfg = SamplerConfig.from_section(cfg.sampler, eos_ids=tuple(tokenizer.stop_ids), pad_id=tokenizer.pad_id, **mode)
    # subword text: streamed as text; toy symbols: block by block
    stream = TextStream(tokenizer, len(texts)) if cfg.data.tokenizer.kind != "toy" else None

    def on_block(b, tokens):
        print(f"[block {b}] " + " | ".join(decode_shown(tokenizer, [int(t) for t in row]) for row in tokens),
              flush=True)

    # on the run's mesh, like the params: the prompts split over its batch axes (not every device decoding them all)
    res = sample(model, prompts, valid, scfg, jax.random.key(args.seed), scfg.mode,
                 on_block=stream.on_block if stream is not None else on_block, mesh=common.run_mesh(cfg.mesh),
                 rules=cfg.mesh.rules)
    if stream is not None:
        answers = stream.finish(res.tokens)
        for i, (text, a, tpf) in enumerate(zip(texts, answers, res.tpf), 1):
            shown = "" if len(texts) == 1 else f"prompt {i} {text!r} -> {decode_shown(tokenizer, a.ids)!r}\n  "
            print(f"{shown}[stop: {stop_reason(tokenizer, a, scfg.max_new_tokens)}; {len(a.ids)} tokens, "
                  f"tokens/forward {tpf:.2f}]")
    else:
        for text, row, tpf in zip(texts, res.tokens, res.tpf):
            out = decode_shown(tokenizer, [int(t) for t in row if int(t) != tokenizer.pad_id])
            print(f"{text!r} -> {out!r}  (tokens/forward {tpf:.2f})")
    print(format_summary(summarize(res, scfg.max_steps)))
    return common.EXIT_OK


if __name__ == "__main__":
    sys.exit(common.standalone(sys.modules[__name__]))
