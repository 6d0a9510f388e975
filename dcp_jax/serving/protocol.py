"""OpenAI-compatible request parsing and validation, the chat template, and token strings (no jax).

`parse_completion` / `parse_chat` turn a decoded JSON body into a frozen request dataclass or raise
`ProtocolError` (an HTTP status and an OpenAI-shaped error body) naming the offending field, before anything is
queued. Fields this server cannot honour (logit_bias, suffix, tools, response_format, best_of != n) are refused,
never ignored.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dcp_jax.host.sampling import SamplingParams
from dcp_jax.host.scheduler import REPLACEMENT_CHAR

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP = 16

# One turn per message, then the assistant's header; the Jinja source below renders the same text.
CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CHAT_ROLES = ("system", "user", "assistant")


class ProtocolError(Exception):
    """A request the server refuses: `status` (400 unless said otherwise) and an OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    model: str | None
    # Each prompt is text (tokenized with BOS) or token ids (used as given, no BOS added).
    prompts: tuple[str | tuple[int, ...], ...]
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    model: str | None
    messages: tuple[dict[str, str], ...]
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int | None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


class _Fields:
    """Typed reads of a JSON object, each failing with a ProtocolError that names the field."""

    def __init__(self, body: Any):
        if not isinstance(body, dict):
            raise ProtocolError(f"the request body must be a JSON object, got {type(body).__name__}")
        self.body = body

    def get(self, name: str, kind: str, default=None, *, low=None, high=None):
        value = self.body.get(name)
        if value is None:
            return default
        ok = {"int": _is_int, "number": _is_number, "bool": lambda v: isinstance(v, bool),
              "str": lambda v: isinstance(v, str), "dict": lambda v: isinstance(v, dict)}[kind](value)
        if not ok:
            raise ProtocolError(f"'{name}' must be {'an' if kind == 'int' else 'a'} {kind}, got {value!r}", name)
        if low is not None and value < low or high is not None and value > high:
            bounds = f">= {low}" if high is None else f"<= {high}" if low is None else f"in [{low}, {high}]"
            raise ProtocolError(f"'{name}' must be {bounds}, got {value!r}", name)
        return value

    def refuse_unsupported(self, **neutral) -> None:
        for name, neutral_value in neutral.items():
            value = self.body.get(name)
            if value is not None and value != neutral_value and not (isinstance(value, (dict, list)) and not value):
                raise ProtocolError(f"'{name}' is not supported by this server (got {value!r})", name)


def _stop(fields: _Fields) -> tuple[str, ...]:
    stop = fields.body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise ProtocolError(f"'stop' must be a non-empty string or a list of up to {MAX_STOP} of them", "stop")
    return tuple(stop)


def _sampling(fields: _Fields, *, max_tokens: int, logprobs: int | None) -> SamplingParams:
    stop_ids = fields.body.get("stop_token_ids")
    if stop_ids is not None and (not isinstance(stop_ids, list) or not all(_is_int(t) and t >= 0 for t in stop_ids)):
        raise ProtocolError("'stop_token_ids' must be a list of non-negative ints", "stop_token_ids")
    top_k = fields.get("top_k", "int", 0, low=-1)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(fields.get("temperature", "number", 1.0, low=0, high=2)),
        top_p=float(_top_p(fields)),
        top_k=top_k,
        min_p=float(fields.get("min_p", "number", 0.0, low=0, high=1)),
        presence_penalty=float(fields.get("presence_penalty", "number", 0.0, low=-2, high=2)),
        frequency_penalty=float(fields.get("frequency_penalty", "number", 0.0, low=-2, high=2)),
        repetition_penalty=float(_repetition_penalty(fields)),
        seed=fields.get("seed", "int", None, low=0, high=2**63 - 1),
        logprobs=logprobs,
        stop=_stop(fields),
        stop_token_ids=tuple(stop_ids or ()),
        ignore_eos=fields.get("ignore_eos", "bool", False),
    )


def _repetition_penalty(fields: _Fields) -> float:
    value = fields.get("repetition_penalty", "number", 1.0)
    if not value > 0:
        raise ProtocolError(f"'repetition_penalty' must be > 0, got {value!r}", "repetition_penalty")
    return value


def _top_p(fields: _Fields) -> float:
    top_p = fields.get("top_p", "number", 1.0)
    if not 0 < top_p <= 1:
        raise ProtocolError(f"'top_p' must be in (0, 1], got {top_p!r}", "top_p")
    return top_p


def _common(fields: _Fields, default_max_tokens: int, max_tokens_name: str = "max_tokens"):
    fields.refuse_unsupported(logit_bias={}, suffix=None, tools=[], response_format=None)
    model = fields.get("model", "str")
    max_tokens = fields.get(max_tokens_name, "int", default_max_tokens, low=1)
    n = fields.get("n", "int", 1, low=1, high=MAX_N)
    stream = fields.get("stream", "bool", False)
    options = fields.get("stream_options", "dict", {})
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise ProtocolError("'stream_options.include_usage' must be a bool", "stream_options")
    return model, max_tokens, n, stream, include_usage


def parse_completion(body: Any, *, default_max_tokens: int = 16) -> CompletionRequest:
    fields = _Fields(body)
    model, max_tokens, n, stream, include_usage = _common(fields, default_max_tokens)
    best_of = fields.get("best_of", "int", n, low=1)
    if best_of != n:
        raise ProtocolError(f"'best_of' other than n is not supported (best_of={best_of}, n={n})", "best_of")
    echo = fields.get("echo", "bool", False)
    logprobs = fields.get("logprobs", "int", None, low=0, high=MAX_LOGPROBS)
    if "prompt" not in fields.body:
        raise ProtocolError("'prompt' is required", "prompt")
    return CompletionRequest(model=model, prompts=_prompts(fields.body["prompt"]),
                             params=_sampling(fields, max_tokens=max_tokens, logprobs=logprobs), n=n, stream=stream,
                             include_usage=include_usage, echo=echo, logprobs=logprobs)


def _prompts(prompt: Any) -> tuple[str | tuple[int, ...], ...]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    error = ProtocolError("'prompt' must be a string, a list of strings, a list of token ids or a list of "
                          "token-id lists, none empty", "prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompts = [tuple(prompt)]
    elif isinstance(prompt, list) and prompt:
        prompts = []
        for p in prompt:
            if isinstance(p, str):
                prompts.append(p)
            elif isinstance(p, list) and p and all(_is_int(t) for t in p):
                prompts.append(tuple(p))
            else:
                raise error
    else:
        raise error
    if any(not p for p in prompts):
        raise error
    return tuple(prompts)


def parse_chat(body: Any, *, default_max_tokens: int = 16) -> ChatRequest:
    fields = _Fields(body)
    name = "max_completion_tokens" if fields.body.get("max_completion_tokens") is not None else "max_tokens"
    model, max_tokens, n, stream, include_usage = _common(fields, default_max_tokens, name)
    want_logprobs = fields.get("logprobs", "bool", False)
    top = fields.get("top_logprobs", "int", None, low=0, high=MAX_LOGPROBS)
    if top is not None and not want_logprobs:
        raise ProtocolError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    messages = fields.body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("'messages' must be a non-empty list", "messages")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise ProtocolError(f"messages[{i}] must be an object with a role in {CHAT_ROLES}", "messages")
        parsed.append({"role": message["role"], "content": _content(message.get("content"), i)})
    params = _sampling(fields, max_tokens=max_tokens, logprobs=(top or 0) if want_logprobs else None)
    return ChatRequest(model=model, messages=tuple(parsed), params=params, n=n, stream=stream,
                       include_usage=include_usage, logprobs=want_logprobs, top_logprobs=top)


def _content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ProtocolError(f"messages[{i}].content must be a string or a list of text parts", "messages")


def apply_chat_template(messages, add_generation_prompt: bool = True) -> str:
    """The Python twin of CHAT_TEMPLATE (tests check they agree)."""
    text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


class TokenizerView:
    """The server's view of a tokenizer: special tokens by name in text, token strings for logprobs."""

    def __init__(self, tokenizer, *, bos_token_id: int | None, eos_token_id: int | None):
        self.tokenizer = tokenizer
        self.is_bytes = hasattr(tokenizer, "offset")  # the ByteTokenizer: specials have no text of their own
        self.specials = {}
        if self.is_bytes:
            self.specials = {name: i for name, i in (("<s>", bos_token_id), ("</s>", eos_token_id)) if i is not None}
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id

    def special_name(self, token_id: int | None) -> str | None:
        return next((name for name, i in self.specials.items() if i == token_id), None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = []
        if add_special_tokens and self.bos_token_id is not None:
            ids.append(self.bos_token_id)
        pieces = [text]
        for name in self.specials:
            pieces = [part for piece in pieces for part in _split_keep(piece, name)]
        for piece in pieces:
            if piece in self.specials:
                ids.append(self.specials[piece])
            elif piece:
                ids += self.tokenizer.encode(piece, add_special_tokens=False)
        return ids

    def decode(self, ids) -> str:
        """Text of `ids`; special tokens have none."""
        return self.tokenizer.decode(list(ids))

    def text_offsets(self, ids) -> list[int]:
        """offsets[i] = len(decode(ids[:i])): where token i's text starts in decode(ids) (a special token's text is
        empty). Incremental: the text is committed at every clean boundary (no unfinished UTF-8 at its end), and
        each decode spans the uncommitted tokens plus one token of context (a tokenizer may spell a token
        differently at the start of a text)."""
        offsets, done, start, head = [], 0, 0, 0  # done = len(decode(ids[:start])); head = that of the context
        for i in range(len(ids)):
            context = max(start - 1, 0)
            piece = self.decode(ids[context:i])
            offsets.append(done + len(piece) - head)
            if not piece.endswith(REPLACEMENT_CHAR):
                done += len(piece) - head
                start = i
                head = len(self.decode(ids[max(i - 1, 0):i]))
        return offsets

    def token_text(self, token_id: int) -> str:
        """One token as text for logprobs; a byte that is not UTF-8 on its own is spelled `bytes:\\xNN`."""
        name = self.special_name(token_id)
        if name is not None:
            return name
        if self.is_bytes:
            b = token_id - self.tokenizer.offset
            if not 0 <= b < 256:
                return f"<id:{token_id}>"
            return chr(b) if b < 0x80 else f"bytes:\\x{b:02x}"
        return self.tokenizer.decode([token_id])


def _split_keep(text: str, sep: str) -> list[str]:
    parts = text.split(sep)
    out = [parts[0]]
    for part in parts[1:]:
        out += [sep, part]
    return out
