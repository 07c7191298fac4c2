"""Conversations (`messages` rows) -> (context, target) token ids, rendered by the tokenizer's own chat template.

A row is `{"messages": [{"role": ..., "content": ...}, ...]}` (the ecosystem's SFT format): roles `system` (first
only), `user`, `assistant`; `content` text; an assistant message may carry `thinking` text (its thought channel,
`<|channel>thought\\n...<channel|>` in Gemma 4's format). Every assistant turn k is one training example:

    context = ids(template(messages[:k], add_generation_prompt=True))        # ends "<|turn>model\\n"
    target  = ids(template(messages[:k + 1]))[len(context):] up to, excluding, the end-of-turn "<turn|>"

so context + target + [<turn|>] is, token for token, the template's rendering of the conversation through that turn
(what follows `<turn|>` there, the newline before the next turn, belongs to the next context). The end-of-turn is
what the response ends on: canvasing appends it as the EOS of a chat tokenizer (`HFTokenizer(chat=True)`), and the
sampler stops on it. Ids are taken from the rendered text with `encode(..., add_special_tokens=False)` (the template
writes BOS itself), and a rendering whose context is not a prefix of the turn's rendering is refused, never patched.

Thinking: `keep` renders each assistant message's `thinking` and, where a conversation has any, passes
`enable_thinking=True` (Gemma 4: `<|think|>` in the system turn); `drop` removes the thinking text before rendering.

`check_messages` raises `BadRow` (a reason without a location; the source adds the file and row) for a row with no
messages, an unknown role, non-text content or thinking, or no assistant turn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

ROLES = ("system", "user", "assistant")
END_OF_TURN = "<turn|>"
THINKING = ("keep", "drop")


class BadRow(ValueError):
    """A `messages` row that cannot be trained on (the reason; the caller names the file and row)."""


def check_messages(row: Any, field: str = "messages") -> list[dict[str, str]]:
    """The row's messages as plain dicts (role, content[, thinking]), or `BadRow` saying what is wrong."""
    if not isinstance(row, Mapping):
        raise BadRow(f"a row must be an object with a {field!r} list, got {type(row).__name__}")
    messages = row.get(field)
    if messages is None or (isinstance(messages, Sequence) and not isinstance(messages, str) and not messages):
        raise BadRow(f"no {field!r}")
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise BadRow(f"{field!r} must be a list of {{'role', 'content'}} objects, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise BadRow(f"message {i} must be an object with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise BadRow(f"message {i}: unknown role {role!r} (roles: {', '.join(ROLES)})")
        if role == "system" and i:
            raise BadRow(f"message {i}: a system message must come first")
        content = m.get("content")
        if not isinstance(content, str):
            raise BadRow(f"message {i} ({role}): content must be text, got {type(content).__name__}")
        msg = {"role": role, "content": content}
        thinking = m.get("thinking")
        if thinking is not None:
            if role != "assistant" or not isinstance(thinking, str):
                raise BadRow(f"message {i} ({role}): 'thinking' must be text on an assistant message")
            if thinking:
                msg["thinking"] = thinking
        out.append(msg)
    if not any(m["role"] == "assistant" for m in out):
        raise BadRow("no assistant turn (nothing to train on)")
    return out


def chat_turns(hf_tokenizer: Any, messages: list[dict[str, str]], *, thinking: str = "keep",
               end_of_turn: str = END_OF_TURN) -> list[tuple[int, list[int], list[int]]]:
    """(message index, context ids, target ids without the end-of-turn) of every assistant turn (module docstring).

    Raises:
      BadRow: the template's rendering of a turn does not extend its context, or the turn has no end-of-turn.
    """
    if thinking not in THINKING:
        raise ValueError(f"thinking must be one of {THINKING}, got {thinking!r}")
    if thinking == "drop":
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    enable = thinking == "keep" and any("thinking" in m for m in messages)
    eot = hf_tokenizer.convert_tokens_to_ids(end_of_turn)

    def ids(msgs: list[dict[str, str]], prompt: bool) -> list[int]:
        kw = {"enable_thinking": True} if enable else {}
        text = hf_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt, **kw)
        return list(hf_tokenizer.encode(text, add_special_tokens=False))

    out = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        context, full = ids(messages[:k], True), ids(messages[:k + 1], False)
        if full[:len(context)] != context:
            raise BadRow(f"message {k}: the chat template's rendering of this turn does not start with its context "
                         "(the rendering with add_generation_prompt=True); the template cannot be split into turns")
        rest = full[len(context):]
        if eot not in rest:
            raise BadRow(f"message {k}: the chat template did not end this assistant turn with {end_of_turn!r}")
        out.append((k, context, rest[:rest.index(eot)]))
    return out


def chat_prompt_ids(hf_tokenizer: Any, text: str) -> list[int]:
    """A free-text prompt as one user turn, rendered with the generation prompt: what a chat model is asked with
    (`dgemma sample` on a chat config)."""
    rendered = hf_tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                add_generation_prompt=True)
    return list(hf_tokenizer.encode(rendered, add_special_tokens=False))
