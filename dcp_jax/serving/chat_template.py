"""Chat templates as HF checkpoints ship them (no jax): found in a model directory (`chat_template.jinja`, else
`tokenizer_config.json`'s `chat_template`), overridden by `--chat-template` (a file or the template itself), and
rendered with jinja2 in a sandbox as transformers' `apply_chat_template` does (`trim_blocks`, `lstrip_blocks`,
`raise_exception`, `tojson`, `strftime_now`; `continue_final_message` cuts the text after the last message's
content). A checkpoint that ships none gets PLAIN_CHAT_TEMPLATE, the project's own.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from collections.abc import Sequence

# BOS, one turn per message (content None renders empty; an open last message with continue_final_message), then
# the assistant's header. `apply_chat_template` renders the same text after BOS in Python (training uses it:
# `train/retrieval.py`). Written for HF's environment, whose trim_blocks drops a newline after a tag.
PLAIN_CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}"
                       "{{ '<|' + message['role'] + '|>\\n' + (message['content'] or '') }}"
                       "{% if not (loop.last and continue_final_message) %}{{ '\\n' }}{% endif %}{% endfor %}"
                       "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")


def apply_chat_template(messages: Sequence[dict], *, add_generation_prompt: bool = True,
                        continue_final_message: bool = False) -> str:
    """The Python twin of PLAIN_CHAT_TEMPLATE after its BOS (a test checks they agree). Messages are dicts with
    `role` and `content` (text or None); other keys (name, tool_call_id) reach a template, and this one does not
    print them."""
    parts = []
    for i, message in enumerate(messages):
        end = "" if continue_final_message and i == len(messages) - 1 else "\n"
        parts.append(f"<|{message['role']}|>\n{message.get('content') or ''}{end}")
    return "".join(parts) + ("<|assistant|>\n" if add_generation_prompt else "")


class ChatTemplateError(ValueError):
    """A template that does not compile, or that refused the conversation (`raise_exception`)."""


def checkpoint_chat_template(model_dir: str | None) -> str | None:
    """The template a model directory ships: `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`
    (a string, or a list of named ones: "default"); None when it ships none."""
    if not model_dir:
        return None
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    path = os.path.join(model_dir, "tokenizer_config.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        template = json.load(f).get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def chat_template_option(option: str) -> str:
    """The template `--chat-template` names: a readable file's text, else the option itself when it is a jinja
    template (it compiles); ValueError otherwise (a mistyped path)."""
    if os.path.isfile(option):
        with open(option, encoding="utf-8") as f:
            option = f.read()
    elif "{" not in option:
        raise ValueError(f"--chat-template {option!r} is neither a readable file nor a jinja template")
    try:
        compile_template(option)
    except ChatTemplateError as e:
        raise ValueError(f"--chat-template: {e}") from None
    return option


def _raise_exception(message):
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def compile_template(source: str):
    """The compiled jinja template of `source` (cached: the server's, and a few requests' own)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from None


def render_chat(source: str, messages: Sequence[dict], *, add_generation_prompt: bool,
                continue_final_message: bool = False, bos_token: str = "", eos_token: str = "",
                template_kwargs: dict | None = None) -> str:
    """The conversation as text through the template `source`. `template_kwargs` (a request's
    `chat_template_kwargs`, e.g. `enable_thinking`) reach the template beside messages, add_generation_prompt,
    bos_token, eos_token and tools (None), which they cannot replace."""
    import jinja2

    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true")
    variables = dict(template_kwargs or {}) | dict(
        messages=list(messages), add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, bos_token=bos_token, eos_token=eos_token, tools=None)
    try:
        text = compile_template(source).render(**variables)
    except ChatTemplateError:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
        raise ChatTemplateError(f"the chat template failed on these messages: {e}") from None
    if continue_final_message and messages:  # transformers': the text ends with the last message's content
        final = messages[-1].get("content") or ""
        if final:
            printed = next((c for c in (final, final.strip()) if c in text), None)  # as given, else trimmed
            if printed is None:
                raise ChatTemplateError("continue_final_message: the template does not print the last message's "
                                        "content")
            text = text[:text.rindex(printed) + len(printed)]
    return text
