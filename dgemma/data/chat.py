"""Conversations (`messages` rows) -> (context, target) token ids, rendered by the tokenizer's own chat template.

A row is `{"messages": [{"role": ..., "content": ...}, ...]}` (the ecosystem's SFT format): roles `system` (first
only), `user`, `assistant`; `content` text; an assistant message may carry `thinking` text (its thought channel,
`<|channel>thought\\n...<channel|>` in Gemma 4's format). Every assistant turn k is one training example:

    context = ids(template(messages[:k], add_generation_prompt=True))        # ends "<|turn>model\\n"
    target  = ids(template(messages[:k + 1]))[len(context):] up to, excluding, the end-of-turn "<turn|>"

so context + target + [<turn|>] is, token for token, the template's rendering of the conversation through that turn
(what follows `<turn|>` there, the newline before the next turn, belongs to the next context). The end-of-turn is
what the response ends on: `to_layout` appends it as the EOS of a chat tokenizer (`HFTokenizer(chat=True)`), and the
sampler stops on it. Ids are taken from the rendered text with `encode(..., add_special_tokens=False)` (the template
writes BOS itself), and a rendering whose context is not a prefix of the turn's rendering is refused, never patched.

Thinking: `keep` renders each assistant message's `thinking` and, where a conversation has any, passes
`enable_thinking=True` (Gemma 4: `<|think|>` in the system turn); `drop` removes the thinking text before rendering.

`check_messages` raises `BadRow` (a reason without a location; the source adds the file and row) for a row with no
messages, an unknown role, non-text content or thinking, or no assistant turn.

Prompting a chat model (`dgemma sample`): `chat_prompt_ids` renders a text as one user turn, and a conversation
(`read_conversation`: one JSON file, checked by `check_conversation` to end on a user turn) is rendered by
`conversation_prompt_ids` exactly as training renders the context of the assistant turn that would follow.
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
    out = _check_message_list(row.get(field), field)
    if not any(m["role"] == "assistant" for m in out):
        raise BadRow("no assistant turn (nothing to train on)")
    return out


def check_conversation(messages: Any, field: str = "messages") -> list[dict[str, str]]:
    """A conversation to answer (`dgemma sample --messages`): the messages as `check_messages` checks them, ending on
    a user turn (the model writes the next assistant turn), or `BadRow` saying what is wrong."""
    out = _check_message_list(messages, field)
    if out[-1]["role"] != "user":
        raise BadRow(f"the conversation ends on a{'n' if out[-1]['role'] == 'assistant' else ''} {out[-1]['role']} "
                     "turn; it must end on a user turn (the model answers it)")
    return out


def _check_message_list(messages: Any, field: str) -> list[dict[str, str]]:
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
    return out


def chat_turns(hf_tokenizer: Any, messages: list[dict[str, str]], *, thinking: str = "keep",
               end_of_turn: str = END_OF_TURN) -> list[tuple[int, list[int], list[int]]]:
    """(message index, context ids, target ids without the end-of-turn) of every assistant turn (module docstring).

    Raises:
      BadRow: the template's rendering of a turn does not extend its context, or the turn has no end-of-turn.
    """
    messages, enable = _thinking_applied(messages, thinking)
    eot = hf_tokenizer.convert_tokens_to_ids(end_of_turn)
    out = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        context = _rendered_ids(hf_tokenizer, messages[:k], prompt=True, enable_thinking=enable)
        full = _rendered_ids(hf_tokenizer, messages[:k + 1], prompt=False, enable_thinking=enable)
        if full[:len(context)] != context:
            raise BadRow(f"message {k}: the chat template's rendering of this turn does not start with its context "
                         "(the rendering with add_generation_prompt=True); the template cannot be split into turns")
        rest = full[len(context):]
        if eot not in rest:
            raise BadRow(f"message {k}: the chat template did not end this assistant turn with {end_of_turn!r}")
        out.append((k, context, rest[:rest.index(eot)]))
    return out


def _thinking_applied(messages: list[dict[str, str]], thinking: str) -> tuple[list[dict[str, str]], bool]:
    """(the messages with their thinking dropped or kept, whether to render with `enable_thinking=True`)."""
    if thinking not in THINKING:
        raise ValueError(f"thinking must be one of {THINKING}, got {thinking!r}")
    if thinking == "drop":
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    return messages, thinking == "keep" and any("thinking" in m for m in messages)


def _rendered_ids(hf_tokenizer: Any, messages: list[dict[str, str]], *, prompt: bool,
                  enable_thinking: bool) -> list[int]:
    kw = {"enable_thinking": True} if enable_thinking else {}
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt, **kw)
    return list(hf_tokenizer.encode(text, add_special_tokens=False))


def conversation_prompt_ids(hf_tokenizer: Any, messages: list[dict[str, str]], *, thinking: str = "keep") -> list[int]:
    """A conversation ending on a user turn (`check_conversation`), rendered with the generation prompt as training
    renders an assistant turn's context (`chat_turns`, `thinking` as there): what the model answers."""
    messages, enable = _thinking_applied(messages, thinking)
    return _rendered_ids(hf_tokenizer, messages, prompt=True, enable_thinking=enable)


def chat_prompt_ids(hf_tokenizer: Any, text: str) -> list[int]:
    """A free-text prompt as one user turn, rendered with the generation prompt: what a chat model is asked with
    (`dgemma sample` on a chat config)."""
    return conversation_prompt_ids(hf_tokenizer, [{"role": "user", "content": text}])


def read_conversation(path: str, field: str = "messages") -> list[dict[str, str]]:
    """The one conversation of a JSON file (`{field: [...]}` or a bare list of messages) that must end on a user
    turn (`check_conversation`); ValueError naming the file and the problem (missing, not JSON, bad messages)."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except (OSError, UnicodeError) as e:
        raise ValueError(f"{path}: cannot read it ({type(e).__name__}: {e})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        if e.msg == "Extra data" and len(lines) > 1:
            raise ValueError(f"{path}: {len(lines)} JSON lines; it must hold one conversation (a file of many is "
                             "`dgemma eval --data`'s)") from None
        raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if isinstance(doc, Mapping):
        if field not in doc:
            raise ValueError(f"{path}: a JSON object without a {field!r} list; expected {{{field!r}: [...]}} or a "
                             "list of messages")
        doc = doc[field]
    try:
        return check_conversation(doc, field)
    except BadRow as e:
        raise ValueError(f"{path}: {e}") from None
