"""Your own prompts: a JSON-lines file of plain text or chat conversations, turned into the token ids the engine gets.

Each line of the file is one prompt, in one of three forms:

    "What is 12 + 30?"                                                   # a JSON string: plain text
    {"prompt": "What is 12 + 30?"}                                       # the same, as an object
    {"messages": [{"role": "user", "content": "What is 12 + 30?"}]}    # a chat: the checkpoint's template applied

A chat is rendered as vLLM's `LLM.chat` renders it: the tokenizer's chat template with the generation prompt added,
as text, then tokenized without special tokens (the template writes them). Every problem (a missing file, a bad line,
a chat for a tokenizer without a template, a prompt that leaves no room to answer) is found here, before any engine
starts, with the line it is on.
"""

from __future__ import annotations

import json
from pathlib import Path

ROLES = ("system", "user", "assistant", "tool")


def read_prompts(path: str | Path) -> list[str | list[dict]]:
    """The prompts of a JSON-lines file (blank lines skipped): a string, or a list of chat messages, per prompt."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist: give a JSON-lines file, one prompt per line")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not JSON ({error.msg}); each line is a JSON string, "
                             '{"prompt": TEXT} or {"messages": [{"role": ..., "content": ...}, ...]}') from None
        prompts.append(_prompt(item, f"{path}:{number}"))
    if not prompts:
        raise ValueError(f"{path} holds no prompt: write one JSON prompt per line")
    return prompts


def _prompt(item, where: str) -> str | list[dict]:
    """One line's prompt, checked: text, or messages with a known role and text content each."""
    if isinstance(item, dict) and set(item) == {"prompt"}:
        item = item["prompt"]
    if isinstance(item, str):
        if not item:
            raise ValueError(f"{where}: an empty prompt")
        return item
    messages = item.get("messages") if isinstance(item, dict) and set(item) == {"messages"} else None
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: expected a JSON string, {{\"prompt\": TEXT}} or {{\"messages\": [...]}}, "
                         f"got {json.dumps(item)[:80]}")
    for m in messages:
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: a message must be {{\"role\": one of {', '.join(ROLES)}, \"content\": TEXT}}, "
                             f"got {json.dumps(m)[:80]}")
    return messages


def prompt_ids(prompts, tokenizer, model_name: str = "the model") -> list[list[int]]:
    """Token ids of each prompt: text encoded as the engine encodes it; a chat (a list of messages) rendered with the
    chat template; token ids kept."""
    ids = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            ids.append(list(tokenizer.encode(p)))
            continue
        if not (isinstance(p, (list, tuple)) and p and all(isinstance(m, dict) for m in p)):
            ids.append([int(t) for t in p])
            continue
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"prompt {i + 1} is a chat, but {model_name}'s tokenizer has no chat template "
                             "(tokenizer_config.json 'chat_template' or chat_template.jinja): give plain-text prompts, "
                             "or a checkpoint whose tokenizer has one")
        text = tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
        ids.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return ids


def check_room(ids: list[list[int]], max_tokens: int, context: int) -> None:
    """Refuse prompts that leave fewer than `max_tokens` positions of the engine's `context` to answer in."""
    for i, p in enumerate(ids):
        if not p:
            raise ValueError(f"prompt {i + 1} has no tokens")
        if len(p) + max_tokens > context:
            raise ValueError(f"prompt {i + 1} has {len(p)} tokens; with {max_tokens} to generate it does not fit the "
                             f"engine's context of {context}: shorten it or lower max_tokens")
