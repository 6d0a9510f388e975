"""OpenAI-compatible request and response models (pydantic, no jax), with vLLM's field names and defaults.

`parse(Model, body)` reads a raw request body: bad JSON (a lone UTF-16 surrogate such as "\\ud800", nesting past
the parser's depth limit), wrong types, out-of-range values, unknown fields and fields this server cannot honour
all raise `ProtocolError` (an HTTP status and an OpenAI-shaped error body naming the field) before anything is
queued. Every request model forbids unknown fields; a vLLM field the engine cannot honour is declared and refused
unless it holds its neutral value (tools, structured output, logit_bias, beam search, ...), never ignored.
`to_sampling_params` turns a request into `SamplingParams` (a ValueError there is a 400 too).
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError, from_json

from dcp_jax.host.sampling import MAX_LOGPROBS, SamplingParams

# The most choices one request may ask for (n times the prompts): each is a request of the engine's.
MAX_CHOICES = 64
_INT64 = dict(ge=-(2**63), le=2**63 - 1)
_INT32 = 2**31 - 1

TOOLS_REFUSED = "tool calling is not supported yet (it needs grammar-masked decoding, a later issue)"
STRUCTURED_REFUSED = ("structured output (guided decoding, response_format json_object / json_schema) is not "
                      "supported yet (it needs grammar-masked decoding, a later issue)")


class ProtocolError(Exception):
    """A request the server refuses: `status` (400 unless said otherwise) and an OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()


def parse(model: type[BaseModel], body: bytes) -> Any:
    """`model` validated from a JSON body; ProtocolError (400) naming what is wrong."""
    return validate(model, parse_json(body))


def parse_json(body: bytes) -> Any:
    try:
        return from_json(body)
    except ValueError as e:  # not JSON, not UTF-8, a lone surrogate, too deep
        raise ProtocolError(f"the body is not valid JSON: {e}") from None


def validate(model: type[BaseModel], data: Any) -> Any:
    """`model` validated from parsed JSON; ProtocolError (400) naming what is wrong."""
    if not isinstance(data, dict):
        raise ProtocolError(f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _protocol_error(e) from None


def _protocol_error(e: ValidationError) -> ProtocolError:
    """The first few errors in one line; `param` is the first error's top-level field."""
    errors = e.errors(include_url=False, include_input=False)
    parts = []
    for err in errors[:3]:
        where = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown field '{where}' (this server does not implement it)")
        else:
            parts.append(f"'{where}': {err['msg']}" if where else err["msg"])
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    param = next((str(err["loc"][0]) for err in errors if err["loc"]), None)
    return ProtocolError("; ".join(parts) + more, param)


# The longest chat template a request may bring (real ones are a few KB).
MAX_CHAT_TEMPLATE_CHARS = 64 << 10


def _refused(reason: str, *neutral: Any):
    """A declared field that must hold None or one of `neutral`: anything else is refused with `reason`."""

    def check(value):
        if value is not None and not any(value == n for n in neutral):
            raise PydanticCustomError("unsupported", "not supported by this server: {reason}", {"reason": reason})
        return value

    return AfterValidator(check)


def _text_format_only(value: dict | None) -> dict | None:
    if value is not None and value != {"type": "text"}:
        if value.get("type") == "text":
            raise PydanticCustomError("unsupported", "only {'type': 'text'} (no other keys) is supported")
        raise PydanticCustomError("unsupported", "not supported by this server: {reason}",
                                  {"reason": STRUCTURED_REFUSED})
    return value


class OpenAIBaseModel(BaseModel):
    # Unknown fields are refused (vLLM logs and ignores them); JSON types are taken as they are (no "3" -> 3).
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True
    # Every chunk carries the usage so far (its choice's completion tokens).
    continuous_usage_stats: bool | None = False


class _SamplingRequest(OpenAIBaseModel):
    """The fields completions and chat share (vLLM's order and defaults)."""

    model: str | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = 0.0
    logit_bias: Annotated[dict[str, float] | None, _refused("logit_bias", {})] = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = 0.0
    seed: Annotated[int, Field(**_INT64)] | None = None
    stop: str | list[str] | None = []
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    user: str | None = None  # the end user's id: accepted, as OpenAI's, with no effect on generation
    # vLLM's sampling extras
    best_of: int | None = None
    use_beam_search: Annotated[bool, _refused("beam search", False)] = False
    top_k: Annotated[int, Field(ge=-1, le=_INT32)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=1e6)] | None = None
    length_penalty: Annotated[float, _refused("length_penalty (beam search)", 1.0)] = 1.0
    stop_token_ids: list[Annotated[int, Field(ge=0, le=_INT32)]] | None = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    skip_special_tokens: Annotated[bool, _refused("special tokens never have text here", True)] = True
    spaces_between_special_tokens: Annotated[bool, _refused("special tokens never have text here", True)] = True
    truncate_prompt_tokens: Annotated[int | None, _refused("truncate_prompt_tokens")] = None
    allowed_token_ids: Annotated[list[int] | None, _refused("allowed_token_ids")] = None
    # Each prompt token's logprob and its top-N (the first, which has no context, None), as vLLM.
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: Annotated[dict[str, Any] | None, AfterValidator(_text_format_only)] = None
    guided_json: Annotated[Any, _refused(STRUCTURED_REFUSED)] = None
    guided_regex: Annotated[Any, _refused(STRUCTURED_REFUSED)] = None
    guided_choice: Annotated[Any, _refused(STRUCTURED_REFUSED)] = None
    guided_grammar: Annotated[Any, _refused(STRUCTURED_REFUSED)] = None
    structural_tag: Annotated[Any, _refused(STRUCTURED_REFUSED)] = None
    guided_decoding_backend: Annotated[Any, _refused(STRUCTURED_REFUSED)] = None
    guided_whitespace_pattern: Annotated[Any, _refused(STRUCTURED_REFUSED)] = None
    priority: Annotated[int, _refused("priority scheduling", 0)] = 0
    # The response's id is `cmpl-{request_id}` (chat: `chatcmpl-`); it must not be live already.
    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    logits_processors: Annotated[Any, _refused("logits_processors")] = None
    # Logprobs name tokens "token_id:{id}" (text that is not UTF-8 on its own stays readable by the client).
    return_tokens_as_token_ids: bool | None = None
    cache_salt: Annotated[Any, _refused("prefix caching")] = None
    kv_transfer_params: Annotated[Any, _refused("disaggregated serving")] = None
    vllm_xargs: Annotated[Any, _refused("vllm_xargs")] = None

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ProtocolError("stream_options can only be defined when stream is true", "stream_options")
        if self.best_of is not None and self.best_of != self.n:
            raise ProtocolError(f"best_of other than n is not supported (best_of={self.best_of}, n={self.n})",
                                "best_of")
        return self

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def to_sampling_params(self, *, max_tokens: int, logprobs: int | None, vocab_size: int,
                           defaults: dict[str, float] | None = None) -> SamplingParams:
        """For what the request leaves unset: `defaults` (the model's generation config, `generation_config.py`),
        else vLLM's; ProtocolError for values the engine refuses."""
        bad = [t for t in self.stop_token_ids or [] if t >= vocab_size]
        if bad:
            raise ProtocolError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})",
                                "stop_token_ids")
        defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0} | (
            defaults or {})

        def value(name: str):
            given = getattr(self, name)
            return defaults[name] if given is None else given

        try:
            return SamplingParams(
                n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, temperature=value("temperature"),
                top_p=value("top_p"), top_k=value("top_k"), min_p=value("min_p"),
                presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=value("repetition_penalty"),
                # vLLM takes any 64-bit seed; the engine keys its draws by the seed's 64 bits.
                seed=None if self.seed is None else self.seed % 2**64,
                logprobs=logprobs, stop=self.stops, stop_token_ids=self.stop_token_ids or [],
                include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos)
        except ValueError as e:  # SamplingParams names the field first: "min_tokens must be ...", "... logprobs ..."
            words = str(e).replace(",", " ").split()
            raise ProtocolError(str(e), next((w for w in words if w in type(self).model_fields), None)) from None


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


class CompletionRequest(_SamplingRequest):
    # A string, a list of strings, token ids or a list of token-id lists (vLLM's types; ids are checked against
    # the vocabulary by the engine).
    prompt: Any
    prompt_embeds: Annotated[Any, _refused("prompt_embeds")] = None
    echo: bool | None = False
    logprobs: Annotated[int, Field(ge=0)] | None = None
    # None: the rest of each prompt's context (max_model_len - its length), as vLLM; 0 with echo: the prompt alone
    # (with its logprobs), nothing generated.
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    suffix: Annotated[str | None, _refused("suffix")] = None
    # A string prompt gets BOS; token-id prompts are used as given.
    add_special_tokens: bool = True

    @field_validator("prompt", mode="plain")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        if isinstance(value, str) or _is_ids(value):
            return value
        if isinstance(value, list) and value and (all(isinstance(p, str) for p in value)
                                                  or all(_is_ids(p) for p in value)):
            return value
        raise PydanticCustomError("prompt", "must be a string, a list of strings, a list of token ids or a list of "
                                            "token-id lists, none of the lists empty")

    @model_validator(mode="after")
    def _check_echo_only(self):
        if self.max_tokens == 0 and not self.echo:
            raise ProtocolError("max_tokens 0 needs echo (the prompt alone, with its logprobs)", "max_tokens")
        return self

    @property
    def echo_only(self) -> bool:
        """Echo with max_tokens 0: the reply is the prompt (and its logprobs); nothing is generated."""
        return bool(self.echo) and self.max_tokens == 0

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt: text or token ids."""
        return [self.prompt] if isinstance(self.prompt, str) or _is_ids(self.prompt) else list(self.prompt)


class TextPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBaseModel):
    """One message; everything given is passed to the chat template (`tokenizer.apply_chat_template`)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # None: an assistant turn without text (the template renders it empty).
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: Annotated[list[Any] | None, _refused(TOOLS_REFUSED, [])] = None

    @property
    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0)] | None = 0
    # None: the rest of the context (max_model_len - prompt), as vLLM.
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: Annotated[list[Any] | None, _refused(TOOLS_REFUSED, [])] = None
    tool_choice: Annotated[Any, _refused(TOOLS_REFUSED, "none")] = "none"
    parallel_tool_calls: Annotated[bool | None, _refused(TOOLS_REFUSED, False)] = None
    functions: Annotated[Any, _refused(TOOLS_REFUSED, [])] = None
    function_call: Annotated[Any, _refused(TOOLS_REFUSED, "none")] = None
    # The reply's content starts with the last message's when that one is the assistant's.
    echo: bool = False
    add_generation_prompt: bool = True
    # The last message stays open: the model continues it (no end of turn, no generation prompt).
    continue_final_message: bool = False
    # True would add a second BOS to the one the chat template starts with.
    add_special_tokens: Annotated[bool, _refused("the chat template already starts with BOS", False)] = False
    # A template of the request's own (the server must trust them: --trust-request-chat-template), and variables
    # for the template (e.g. enable_thinking), as vLLM.
    chat_template: Annotated[str, Field(max_length=MAX_CHAT_TEMPLATE_CHARS)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: Annotated[Any, _refused("documents")] = None
    mm_processor_kwargs: Annotated[Any, _refused("multimodal inputs")] = None

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs and not self.logprobs:
            raise ProtocolError("when using top_logprobs, logprobs must be set to true", "top_logprobs")
        _check_generation_prompt(self)
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(OpenAIBaseModel):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: Annotated[bool, _refused("the chat template already starts with BOS", False)] = False
    return_token_strs: bool | None = False
    chat_template: Annotated[str, Field(max_length=MAX_CHAT_TEMPLATE_CHARS)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self):
        _check_generation_prompt(self)
        return self


def _check_generation_prompt(request) -> None:
    if request.continue_final_message and request.add_generation_prompt:
        raise ProtocolError("cannot set both continue_final_message and add_generation_prompt to true "
                            "(add_generation_prompt defaults to true)", "continue_final_message")


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=_INT32)]]


# ---- responses ------------------------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "dcp-jax"
    root: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class PromptLogprob(BaseModel):
    """vLLM's Logprob: a token's logprob, its rank among the top-N (None past them), its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class ChatCompletionLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = []


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionResponseStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# Items serialized per call by `tokenize_response_json`.
JSON_SLICE = 1 << 14


def tokenize_response_json(tokens: list[int], max_model_len: int, token_strs: list[str] | None) -> bytes:
    """vLLM's /tokenize reply (`count`, `max_model_len`, `tokens`, `token_strs` when asked) as JSON, serialized
    JSON_SLICE items per call: a long prompt's reply never holds the GIL, which the engine's thread needs every step,
    for longer than a slice (pydantic serializes a list in one call: 0.4 s for 15M tokens)."""
    pieces = [b'{"count":%d,"max_model_len":%d' % (len(tokens), max_model_len)]
    for name, items in (("tokens", tokens), ("token_strs", token_strs)):
        if items is not None:
            pieces.append(b',"%s":[' % name.encode())
            pieces += [(b"," if i else b"") + json.dumps(items[i: i + JSON_SLICE], separators=(",", ":"))[1:-1].encode()
                       for i in range(0, len(items), JSON_SLICE)]
            pieces.append(b"]")
    return b"".join(pieces + [b"}"])


class DetokenizeResponse(BaseModel):
    prompt: str
