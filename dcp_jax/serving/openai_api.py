"""The OpenAI-compatible routes (FastAPI) over an `Engine`.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both with server-sent events when
`stream`), POST /tokenize, POST /detokenize, GET /tokenizer_info, GET /health (and /ping), GET /version, GET
/metrics (Prometheus text).
Every body is read (within `body_timeout_s`, at most MAX_BODY_BYTES), parsed and validated (`protocol.py`,
`Engine.validate`) before anything is queued; a bad one gets a 4xx with an OpenAI-shaped `{"error": {...}}`, never
a 500 or an HTML page. Until the engine is ready, and once the server drains, /health and the generating routes
answer 503. The engine's events of a whole step reach this loop in one call (`streams.LoopSink`) and go to the
queue of their HTTP request. A client that goes away aborts its requests, so their KV pages return to the pool.
`server.py` serves this app and owns its lifecycle.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from dcp_jax.host.sampling import SamplingParams, TokenLogprob
from dcp_jax.serving import protocol
from dcp_jax.serving.engine import Engine, EngineStoppedError
from dcp_jax.serving.generation_config import sampling_defaults
from dcp_jax.serving.metrics import CONTENT_TYPE
from dcp_jax.serving.protocol import ProtocolError
from dcp_jax.serving.streams import LoopSink, StreamEvent
from dcp_jax.config import model_directory
from dcp_jax.serving.chat_template import PLAIN_CHAT_TEMPLATE, ChatTemplateError, render_chat
from dcp_jax.serving.tokenizer import TokenizerView

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20


@dataclasses.dataclass
class CorsOptions:
    """vLLM's `--allowed-origins`, `--allowed-methods`, `--allowed-headers`, `--allow-credentials`. No origin by
    default (vLLM allows every one): a web page of another origin cannot read a reply, and a body whose
    Content-Type is not JSON (what a page may send without asking) is refused (`_read_body`)."""

    allowed_origins: Sequence[str] = ()
    allowed_methods: Sequence[str] = ("*",)
    allowed_headers: Sequence[str] = ("*",)
    allow_credentials: bool = False


class _Choice:
    """The events of one choice gathered for a whole reply."""

    def __init__(self):
        self.token_ids, self.text, self.logprobs = [], "", []
        self.prompt_token_ids, self.prompt_logprobs = None, None
        self.finish_reason, self.stop_reason, self.error = None, None, None

    def add(self, event: StreamEvent) -> None:
        if event.prompt_token_ids is not None:
            self.prompt_token_ids, self.prompt_logprobs = event.prompt_token_ids, event.prompt_logprobs
        self.token_ids += event.token_ids
        self.text += event.text
        self.logprobs += event.logprobs or []
        self.finish_reason, self.stop_reason, self.error = event.finish_reason, event.stop_reason, event.error


class Submission:
    """The engine requests of one HTTP request (its choices: choice i is request `ids[i]`, tag i) and the queue
    their events come to."""

    def __init__(self, serving: OpenAIServing, ids: list[str]):
        self.serving, self.ids = serving, ids
        self.queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self.live = len(ids)

    async def events(self) -> AsyncIterator[StreamEvent]:
        """Every event of every choice, until each has finished."""
        while self.live:
            event = await self.queue.get()
            if event.finish_reason is not None:
                self.live -= 1
            yield event

    def abort(self) -> None:
        """Cancel the unfinished choices (their pages return to the pool; their streams end with "abort")."""
        for request_id in self.ids:
            self.serving.engine.abort(request_id)

    def close(self) -> None:
        """Done with it: abort what is unfinished, stop routing its events."""
        if self.live:
            self.abort()
        self.serving.forget(self)


class OpenAIServing:
    """What the routes share: the engine (None until it is ready), its tokenizer view, the chat template, the
    served model name, the sink that brings the engine's events to this loop, and the requests in flight
    (`abort_all` when draining). `chat_template`: vLLM's --chat-template (the template's text; default: the
    checkpoint's, else the project's plain one); `trust_request_chat_template`: a request may bring its own."""

    def __init__(self, *, served_model_name: str | Sequence[str] | None = None, api_key: str | None = None,
                 body_timeout_s: float = 30.0, chat_template: str | None = None,
                 trust_request_chat_template: bool = False):
        # vLLM's --served-model-name: replies name the first; a request may name any.
        self.served_model_names = [served_model_name] if isinstance(served_model_name, str) else list(
            served_model_name or [])
        self.api_key, self.body_timeout_s = api_key, body_timeout_s
        self.chat_template = chat_template
        self.trust_request_chat_template = trust_request_chat_template
        self.engine: Engine | None = None
        self.tokens: TokenizerView | None = None
        self.sink: LoopSink | None = None
        self.created = int(time.time())
        self.is_draining = False
        self.in_flight: set[Submission] = set()

    def attach(self, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        """Serve `engine` (started) from now on; its events come to `loop`."""
        self.tokens = TokenizerView(engine.tokenizer, bos_token_id=engine.model_config.bos_token_id,
                                    eos_token_id=engine.model_config.eos_token_id)
        self.sink = LoopSink(loop)
        self.served_model_names = self.served_model_names or [engine.model_name]
        self.chat_template = self.chat_template or engine.tokenizer.chat_template or PLAIN_CHAT_TEMPLATE
        self.sampling_defaults = sampling_defaults(engine.args.generation_config, model_directory(engine.args.model))
        self.max_logprobs = engine.args.max_logprobs
        self.engine = engine

    @property
    def model_name(self) -> str:
        """The name replies carry: the first served name."""
        return self.served_model_names[0] if self.served_model_names else "(loading)"

    def ready_engine(self) -> Engine:
        """The engine, or a 503 while it loads, once the server drains, or when its loop stopped."""
        if self.engine is None:
            raise ProtocolError("the server is starting: the model is not ready yet", status=503,
                                type="service_unavailable")
        if self.is_draining:
            raise ProtocolError("the server is shutting down", status=503, type="service_unavailable")
        if not self.engine.is_alive:
            raise ProtocolError("the engine is not running: the server cannot take requests", status=503,
                                type="service_unavailable")
        return self.engine

    def chat_prompt(self, req: protocol.ChatCompletionRequest | protocol.TokenizeChatRequest) -> list[int]:
        """The request's messages through the chat template (the server's, or the request's own when trusted),
        tokenized as the template wrote them (its BOS included, none added)."""
        template = self.chat_template
        if req.chat_template is not None:
            if not self.trust_request_chat_template:
                raise ProtocolError("chat_template is passed with the request, but the server was not started "
                                    "with --trust-request-chat-template", "chat_template")
            template = req.chat_template
        tokens = self.tokens
        messages = [m.model_dump(exclude_none=True) | {"content": m.text} for m in req.messages]
        try:
            text = render_chat(template, messages, add_generation_prompt=req.add_generation_prompt,
                               continue_final_message=req.continue_final_message,
                               bos_token=tokens.special_text(tokens.bos_token_id),
                               eos_token=tokens.special_text(tokens.eos_token_id),
                               template_kwargs=req.chat_template_kwargs)
        except ChatTemplateError as e:
            raise ProtocolError(str(e), "chat_template" if req.chat_template is not None else "messages") from None
        return tokens.encode(text, add_special_tokens=False)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            served = ", ".join(f"'{name}'" for name in self.served_model_names)
            raise ProtocolError(f"the model '{model}' does not exist; this server serves {served}",
                                "model", status=404, type="NotFoundError", code="model_not_found")

    def sampling_params(self, req, *, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The request's SamplingParams: the generation config's defaults for what it leaves unset, its logprobs
        within --max-logprobs."""
        for name, asked in (("logprobs", logprobs), ("prompt_logprobs", req.prompt_logprobs)):
            if asked is not None and asked > self.max_logprobs:
                raise ProtocolError(f"{name}={asked} is over this server's --max-logprobs (max allowed: "
                                    f"{self.max_logprobs})",
                                    "top_logprobs" if isinstance(req, protocol.ChatCompletionRequest) and
                                    name == "logprobs" else name)
        return req.to_sampling_params(max_tokens=max_tokens, logprobs=logprobs,
                                      vocab_size=self.engine.model_config.vocab_size,
                                      defaults=self.sampling_defaults)

    def submit(self, response_id: str, prompts: list[list[int]], params: list[SamplingParams], *,
               prompt_logprobs: int | None) -> Submission:
        """Validate every prompt (prompt i with `params[i]`), then queue params[i].n choices of each (choice index
        = prompt * n + j, drawing from `params[i].for_choice(j)`)."""
        engine = self.ready_engine()
        n = params[0].n
        if len(prompts) * n > protocol.MAX_CHOICES:
            raise ProtocolError(f"{len(prompts)} prompts x n={n} choices exceed {protocol.MAX_CHOICES}", "n")
        choice_params = [[p.for_choice(j) for j in range(n)] for p in params]
        for i, ids in enumerate(prompts):
            try:
                engine.validate(ids, choice_params[i][0], prompt_logprobs)
            except ValueError as e:
                raise ProtocolError(f"prompt {i}: {e}" if len(prompts) > 1 else str(e), "prompt") from None
        ids = [f"{response_id}-{index}" for index in range(len(prompts) * n)]
        # A live request of the same id keeps its route and runs on: only this one is refused.
        if any(self.sink.is_routed(request_id) for request_id in ids):
            raise ProtocolError(f"duplicate request id {response_id!r}: a request of that id is still running",
                                "request_id")
        submission = Submission(self, ids)
        for request_id in ids:
            self.sink.route(request_id, submission.queue)
        self.in_flight.add(submission)
        queued = 0
        try:
            for index, request_id in enumerate(ids):
                engine.add_request(prompts[index // n], choice_params[index // n][index % n], self.sink, tag=index,
                                   prompt_logprobs=prompt_logprobs, request_id=request_id)
                queued += 1
        except (ValueError, EngineStoppedError) as e:
            self.forget(submission)
            for request_id in ids[:queued]:  # only what this submission queued (an id still live is another's)
                engine.abort(request_id)
            if isinstance(e, EngineStoppedError):
                raise ProtocolError(f"{e}: the server cannot take requests", status=503,
                                    type="service_unavailable") from None
            # A duplicate id the engine still holds (its client gone, its abort not yet applied).
            raise ProtocolError(str(e), "request_id") from None
        return submission

    def forget(self, submission: Submission) -> None:
        for request_id in submission.ids:
            self.sink.unroute(request_id)
        self.in_flight.discard(submission)

    def abort_all(self) -> int:
        """Abort every request in flight (each stream still ends with a final chunk and [DONE]); how many HTTP
        requests that was."""
        for submission in self.in_flight:
            submission.abort()
        return len(self.in_flight)


def build_app(serving: OpenAIServing, *, cors: CorsOptions = CorsOptions(), root_path: str = "") -> FastAPI:
    app = FastAPI(title="dcp-jax", root_path=root_path, openapi_url=None)
    app.add_middleware(_ApiKeyMiddleware, serving=serving)
    # Added last, so outermost: preflight requests are answered without an API key (as vLLM does).
    app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                       allow_methods=list(cors.allowed_methods), allow_headers=list(cors.allowed_headers),
                       allow_credentials=cors.allow_credentials)

    @app.exception_handler(ProtocolError)
    async def protocol_error(request: Request, e: ProtocolError):
        return _error(e, headers={"Connection": "close"} if isinstance(e, _Closing) else None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # no route (404), wrong method (405)
        kind = "NotFoundError" if e.status_code == 404 else "invalid_request_error"
        return _error(ProtocolError(f"{e.detail}: {request.method} {request.url.path}", status=e.status_code,
                                    type=kind), headers=e.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):  # a bug answering this request fails it alone
        log.exception("%s %s failed", request.method, request.url.path)
        return _error(ProtocolError(f"internal error: {e}", status=500, type="server_error"))

    @app.api_route("/version", methods=["GET", "HEAD"])
    async def version():
        return JSONResponse({"version": _version()})

    @app.api_route("/health", methods=["GET", "HEAD"])
    @app.api_route("/ping", methods=["GET", "POST", "HEAD"])  # vLLM's (SageMaker's) name for it
    async def health():
        if serving.engine is None:
            status = "starting"
        elif serving.is_draining:
            status = "draining"
        else:
            status = "ok" if serving.engine.is_alive else "engine stopped"
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics():
        engine = _loaded(serving)
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        engine = _loaded(serving)
        cards = [protocol.ModelCard(id=name, created=serving.created, root=engine.model_name,
                                    max_model_len=engine.engine_config.max_model_len)
                 for name in serving.served_model_names]
        return _json(protocol.ModelList(data=cards))

    @app.api_route("/tokenizer_info", methods=["GET", "HEAD"])
    async def tokenizer_info():
        engine, tokens = _loaded(serving), serving.tokens
        return JSONResponse({
            "tokenizer_class": type(engine.tokenizer).__name__,
            "bos_token": tokens.special_name(tokens.bos_token_id),
            "eos_token": tokens.special_name(tokens.eos_token_id), "pad_token": None,
            "chat_template": serving.chat_template,
            "model_max_length": engine.engine_config.max_model_len, "vocab_size": engine.model_config.vocab_size})

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _read_body(request, serving.body_timeout_s)
        engine = _loaded(serving)
        data = await asyncio.to_thread(protocol.parse_json, body)  # a large body's parse never holds the loop
        chat = isinstance(data, dict) and "messages" in data
        req = protocol.validate(protocol.TokenizeChatRequest if chat else protocol.TokenizeCompletionRequest, data)
        serving.check_model(req.model)
        if chat:
            ids = await asyncio.to_thread(serving.chat_prompt, req)
        else:
            ids = await asyncio.to_thread(serving.tokens.encode, req.prompt, add_special_tokens=req.add_special_tokens)

        def reply() -> bytes:
            strs = [serving.tokens.token_text(t) for t in ids] if req.return_token_strs else None
            return protocol.tokenize_response_json(ids, engine.engine_config.max_model_len, strs)

        return Response(await asyncio.to_thread(reply), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _read_body(request, serving.body_timeout_s)
        engine = _loaded(serving)
        req = await asyncio.to_thread(protocol.parse, protocol.DetokenizeRequest, body)
        serving.check_model(req.model)
        vocab = engine.model_config.vocab_size
        if any(t >= vocab for t in req.tokens):
            raise ProtocolError(f"'tokens' must be token ids in [0, {vocab})", "tokens")
        return _json(protocol.DetokenizeResponse(prompt=serving.tokens.decode(req.tokens)))

    @app.post("/v1/completions")
    async def create_completion(request: Request):
        body = await _read_body(request, serving.body_timeout_s)
        req = await asyncio.to_thread(protocol.parse, protocol.CompletionRequest, body)
        engine = serving.ready_engine()  # (before the model name: unknown while the engine loads)
        serving.check_model(req.model)
        if len(req.prompts) * req.n > protocol.MAX_CHOICES:  # before any tokenizing
            raise ProtocolError(f"{len(req.prompts)} prompts x n={req.n} choices exceed {protocol.MAX_CHOICES}", "n")
        prompts = await asyncio.to_thread(  # a large prompt's tokenization never holds up the event loop
            lambda: [serving.tokens.encode(p, add_special_tokens=req.add_special_tokens) if isinstance(p, str)
                     else list(p) for p in req.prompts])
        # An echo without generation runs the prefill, which samples one token; the reply drops it (vLLM's way).
        max_tokens = 1 if req.echo_only else req.max_tokens
        params = [serving.sampling_params(req, max_tokens=_max_tokens(max_tokens, prompt, engine, "prompt"),
                                          logprobs=req.logprobs) for prompt in prompts]
        prompt_logprobs = _prompt_logprobs(req, req.logprobs if req.echo else None)
        response_id = f"cmpl-{req.request_id or uuid.uuid4().hex}"
        submission = serving.submit(response_id, prompts, params, prompt_logprobs=prompt_logprobs)
        completions = _Completions(serving, req, prompts, response_id)
        if req.stream:
            return _sse(completions.stream(submission))
        return _json(await _with_disconnect(request, completions.reply(submission), submission))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request):
        body = await _read_body(request, serving.body_timeout_s)
        req = await asyncio.to_thread(protocol.parse, protocol.ChatCompletionRequest, body)
        engine = serving.ready_engine()  # (before the model name: unknown while the engine loads)
        serving.check_model(req.model)
        prompt = await asyncio.to_thread(serving.chat_prompt, req)
        params = serving.sampling_params(req, max_tokens=_max_tokens(req.requested_max_tokens, prompt, engine,
                                                                      "messages"),
                                         logprobs=(req.top_logprobs or 0) if req.logprobs else None)
        response_id = f"chatcmpl-{req.request_id or uuid.uuid4().hex}"
        submission = serving.submit(response_id, [prompt], [params], prompt_logprobs=_prompt_logprobs(req, None))
        chat = _ChatCompletions(serving, req, len(prompt), response_id)
        if req.stream:
            return _sse(chat.stream(submission))
        return _json(await _with_disconnect(request, chat.reply(submission), submission))

    return app


# ---- plumbing --------------------------------------------------------------------------------------------------
class _ApiKeyMiddleware:
    """With an API key, every /v1 route needs `Authorization: Bearer KEY` (a 401 otherwise)."""

    def __init__(self, app, serving: OpenAIServing):
        self.app, self.serving = app, serving

    async def __call__(self, scope, receive, send):
        key = self.serving.api_key
        if scope["type"] == "http" and key is not None and \
                scope["path"].removeprefix(scope.get("root_path", "")).startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {key}".encode()):
                error = ProtocolError("invalid API key", status=401, type="authentication_error",
                                      code="invalid_api_key")
                await _error(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _max_tokens(requested: int | None, prompt: list[int], engine: Engine, param: str) -> int:
    """`requested`, or when None the rest of the prompt's context (vLLM's: max_model_len - its length)."""
    if requested is not None:
        return requested
    max_model_len = engine.engine_config.max_model_len
    if len(prompt) >= max_model_len:
        raise ProtocolError(f"the prompt's {len(prompt)} tokens leave no room to generate within "
                            f"max_model_len={max_model_len}", param)
    return max_model_len - len(prompt)


def _prompt_logprobs(req, echoed: int | None) -> int | None:
    """Top-N of the prompt's logprobs the engine computes: for the request's `prompt_logprobs` and for an echo with
    logprobs (`echoed`), the larger."""
    wanted = [n for n in (req.prompt_logprobs, echoed) if n is not None]
    return max(wanted) if wanted else None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dcp-jax")
    except PackageNotFoundError:  # a source checkout that was never installed
        return "unknown"


def _token_namer(serving: OpenAIServing, req) -> Callable[[int], str]:
    """How logprobs name a token: its text, or "token_id:{id}" with `return_tokens_as_token_ids` (vLLM's)."""
    if req.return_tokens_as_token_ids:
        return lambda token_id: f"token_id:{token_id}"
    return serving.tokens.token_text


def _top(lp: TokenLogprob, n: int) -> dict[int, float]:
    """The token's own entry and at most `n` of the most likely after it (the engine may have computed more)."""
    return dict(list(lp.top.items())[:1 + n])


def _prompt_logprob_entries(prompt_ids, lps, n: int, name) -> list[dict[str, protocol.PromptLogprob] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, else {token id: {logprob, rank,
    decoded_token}} of the token and the `n` most likely; rank is the place among those (None for the token when
    it is not one of them)."""
    out = [None]
    for token_id, lp in zip(prompt_ids[1:], (lps or [None])[1:]):
        if lp is None:
            out.append(None)
            continue
        top = _top(lp, n)
        others = [v for t, v in top.items() if t != token_id]
        # The token is one of the n most likely unless n others are, all above it: then its rank is unknown.
        unranked = len(others) >= n and all(v > lp.logprob for v in others)
        ranked = sorted(top.items(), key=lambda kv: -kv[1])
        out.append({str(t): protocol.PromptLogprob(logprob=v, rank=None if t == token_id and unranked else place + 1,
                                                   decoded_token=name(t)) for place, (t, v) in enumerate(ranked)})
    return out


def _error(e: ProtocolError, headers=None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _json(model, **kw) -> Response:
    return Response(model.model_dump_json(**kw), media_type="application/json")


def _sse(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _loaded(serving: OpenAIServing) -> Engine:
    if serving.engine is None:
        raise ProtocolError("the server is starting: the model is not ready yet", status=503,
                            type="service_unavailable")
    return serving.engine


async def _read_body(request: Request, timeout_s: float) -> bytes:
    """The whole body (chunked or not): 408 when it does not arrive within `timeout_s` (a body shorter than its
    Content-Length), 413 past MAX_BODY_BYTES (at once when Content-Length says so); refused before it is read, a
    Content-Type other than JSON (415: what a web page of another origin may send without a CORS preflight) and a
    Content-Length beside chunked encoding (400, RFC 9112 6.3). Each error closes the connection."""
    headers = request.headers
    content_type = headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if content_type != "application/json" and not content_type.endswith("+json"):
        raise _Closing(ProtocolError(f"the body must be JSON (Content-Type: application/json), not {content_type}",
                                     status=415, type="invalid_request_error"))
    if "content-length" in headers and "chunked" in headers.get("transfer-encoding", "").lower():
        raise _Closing(ProtocolError("a request may not have both Content-Length and chunked Transfer-Encoding"))
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _Closing(ProtocolError(f"the request body is over {MAX_BODY_BYTES} bytes", status=413))
    chunks, size = [], 0

    async def read():
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise ProtocolError(f"the request body is over {MAX_BODY_BYTES} bytes", status=413)
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout_s)
    except TimeoutError:
        raise _Closing(ProtocolError(f"the request body did not arrive within {timeout_s:g} s", status=408,
                                     type="timeout")) from None
    except ProtocolError as e:
        raise _Closing(e) from None
    except ClientDisconnect:  # nobody is left to answer
        raise ProtocolError("the client disconnected while sending the body") from None
    return b"".join(chunks)


class _Closing(ProtocolError):
    """An error after which the connection cannot be reused (its body was not read to the end)."""

    def __init__(self, e: ProtocolError):
        super().__init__(e.message, e.param, status=e.status, type=e.type, code=e.code)


async def _with_disconnect(request: Request, reply, submission: Submission):
    """Await `reply` (a coroutine gathering a whole reply); when the client goes away first, abort its
    requests."""
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(reply), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            work.cancel()
            raise ProtocolError("the client disconnected")
        return work.result()
    finally:
        watch.cancel()
        submission.close()


async def _gather(submission: Submission) -> dict[int, _Choice]:
    """Every choice's events; a failed choice is a 500, an aborted one (the server draining) a 503."""
    choices: dict[int, _Choice] = {}
    async for event in submission.events():
        choices.setdefault(event.tag, _Choice()).add(event)
    errors = [c.error for c in choices.values() if c.finish_reason == "error"]
    if errors:
        raise ProtocolError(f"generation failed: {errors[0]}", status=500, type="server_error")
    if any(c.finish_reason == "abort" for c in choices.values()):
        raise ProtocolError("the request was aborted: the server is shutting down", status=503,
                            type="service_unavailable")
    return choices


def _sse_data(model) -> str:
    return f"data: {model.model_dump_json(exclude_unset=True)}\n\n"


def _error_event(event: StreamEvent) -> str:
    """After the 200 header only an event can carry a failure."""
    body = ProtocolError(f"generation failed: {event.error}", status=500, type="server_error").body()
    return f"data: {protocol.ErrorResponse.model_validate(body).model_dump_json()}\n\n"


async def _stream_choices(submission: Submission, chunk, final_usage, rid: str) -> AsyncIterator[str]:
    """The choices' chunks, then the usage when asked, then [DONE]. A failed choice ends the stream with an error
    event (no [DONE]); so does a bug (logged), never a JSON error body; a client gone cancels it; whatever ends
    it aborts the choices still running."""
    try:
        async for event in submission.events():
            if event.finish_reason == "error":
                yield _error_event(event)
                return
            yield _sse_data(chunk(event))
        usage = final_usage()
        if usage is not None:
            yield usage
        yield "data: [DONE]\n\n"
    except Exception:
        log.exception("streaming %s failed", rid)
    finally:
        submission.close()


class _Completions:
    """Replies of one /v1/completions request: whole, or as a stream of chunks."""

    def __init__(self, serving: OpenAIServing, req: protocol.CompletionRequest, prompts: list[list[int]],
                 response_id: str):
        self.serving, self.req, self.prompts, self.id = serving, req, prompts, response_id
        self.tokens, self.name = serving.tokens, _token_namer(serving, req)
        self.prompt_tokens = sum(len(p) for p in prompts)  # each prompt once, whatever n (vLLM's usage)
        self.generated = 0
        # Per choice: its echo's length, its text streamed so far (the echo included), its tokens so far.
        self.echo_chars: dict[int, int] = {}
        self.sent_chars: dict[int, int] = {}
        self.sent_tokens: dict[int, int] = {}

    def _prompt_of(self, index: int) -> list[int]:
        return self.prompts[index // self.req.n]

    async def reply(self, submission: Submission) -> protocol.CompletionResponse:
        choices = await _gather(submission)
        req, out = self.req, []
        for index, choice in sorted(choices.items()):
            prompt = self._prompt_of(index)
            echo = self.tokens.decode(prompt) if req.echo else ""
            generated, finish_reason, stop_reason = self._generated(choice.text, choice.finish_reason,
                                                                    choice.stop_reason)
            text = echo + generated
            logprobs = None
            if req.logprobs is not None:
                logprobs = self._logprobs(prompt if req.echo else [], choice.prompt_logprobs,
                                          [] if req.echo_only else choice.logprobs, base=len(echo), end=len(text))
            out.append(protocol.CompletionResponseChoice(
                index=index, text=text, logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason,
                prompt_logprobs=self._prompt_logprobs(prompt, choice.prompt_logprobs)))
        completion_tokens = 0 if req.echo_only else sum(len(c.token_ids) for c in choices.values())
        return protocol.CompletionResponse(id=self.id, model=self.serving.model_name, choices=out,
                                           usage=protocol.UsageInfo.of(self.prompt_tokens, completion_tokens))

    def stream(self, submission: Submission) -> AsyncIterator[str]:
        return _stream_choices(submission, self._chunk, self._final_usage, self.id)

    def _generated(self, text: str, finish_reason: str | None, stop_reason) -> tuple[str, str | None, Any]:
        """(text, finish_reason, stop_reason) a choice reports of its generation: for an echo alone, none of the
        token its prefill sampled, finished by length (max_tokens 0)."""
        if not self.req.echo_only:
            return text, finish_reason, stop_reason
        return "", None if finish_reason is None else "length", None

    def _chunk(self, event: StreamEvent) -> protocol.CompletionStreamResponse:
        """One choice's delta; text_offset stays an index into the choice's whole streamed text."""
        req, index = self.req, event.tag
        generated, finish_reason, stop_reason = self._generated(event.text, event.finish_reason, event.stop_reason)
        generated_ids = [] if req.echo_only else event.token_ids
        text, echoed = generated, []
        if req.echo and event.prompt_token_ids is not None:
            echoed = self._prompt_of(index)
            text = self.tokens.decode(echoed) + text
        base = self.echo_chars.setdefault(index, len(text) - len(generated))
        self.sent_chars[index] = self.sent_chars.get(index, 0) + len(text)
        choice = protocol.CompletionResponseChoice(index=index, text=text, finish_reason=finish_reason,
                                                   stop_reason=stop_reason)
        if event.prompt_token_ids is not None and req.prompt_logprobs is not None:  # the choice's first chunk
            choice.prompt_logprobs = self._prompt_logprobs(self._prompt_of(index), event.prompt_logprobs)
        if req.logprobs is not None:
            end = self.sent_chars[index] if event.finish_reason is not None else None
            choice.logprobs = self._logprobs(echoed, event.prompt_logprobs,
                                             [] if req.echo_only else event.logprobs or [], base=base, end=end)
        chunk = protocol.CompletionStreamResponse(id=self.id, model=self.serving.model_name, choices=[choice])
        self.generated += len(generated_ids)
        self.sent_tokens[index] = self.sent_tokens.get(index, 0) + len(generated_ids)
        if req.continuous_usage:  # vLLM's: this choice's prompt and its tokens so far
            chunk.usage = protocol.UsageInfo.of(len(self._prompt_of(index)), self.sent_tokens[index])
        return chunk

    def _prompt_logprobs(self, prompt: list[int], lps):
        if self.req.prompt_logprobs is None:
            return None
        return _prompt_logprob_entries(prompt, lps, self.req.prompt_logprobs, self.name)

    def _final_usage(self) -> str | None:
        if not self.req.include_usage:
            return None
        return _sse_data(protocol.CompletionStreamResponse(
            id=self.id, model=self.serving.model_name, choices=[],
            usage=protocol.UsageInfo.of(self.prompt_tokens, self.generated)))

    def _logprobs(self, echoed: list[int], prompt_lps, lps: list[TokenLogprob], *, base: int,
                  end: int | None) -> protocol.CompletionLogProbs:
        """OpenAI `logprobs` of the echoed prompt tokens, then the generated ones. `text_offset` indexes the
        choice's returned text: echoed token i starts at len(decode(echoed[:i])) (BOS has no text), a generated
        token at `base` (the text before this chunk's generated text) + where it starts in the generated text,
        clamped to `end` (the text's length once known: a stop string may have cut the text before the last
        tokens)."""
        name, n = self.name, self.req.logprobs
        offsets = self.tokens.text_offsets(echoed) + [base + lp.text_offset for lp in lps]
        entries = list(zip(echoed, prompt_lps or [None] * len(echoed))) + [(lp.token_id, lp) for lp in lps]
        return protocol.CompletionLogProbs(
            tokens=[name(token_id) for token_id, _ in entries],
            token_logprobs=[None if lp is None else lp.logprob for _, lp in entries],
            top_logprobs=[None if lp is None else {name(t): v for t, v in _top(lp, n).items()}
                          for _, lp in entries],
            text_offset=[offset if end is None else min(offset, end) for offset in offsets])


class _ChatCompletions:
    """Replies of one /v1/chat/completions request: whole, or as a stream of chunks."""

    def __init__(self, serving: OpenAIServing, req: protocol.ChatCompletionRequest, prompt_tokens: int,
                 response_id: str):
        self.serving, self.req, self.prompt_tokens, self.id = serving, req, prompt_tokens, response_id
        self.name = _token_namer(serving, req)
        self.generated = 0
        self.sent_tokens: dict[int, int] = {}
        last = req.messages[-1]
        # vLLM's echo: the reply starts with the last message's text when that message is the assistant's.
        self.echo = last.text if req.echo and last.role == "assistant" else ""

    async def reply(self, submission: Submission) -> protocol.ChatCompletionResponse:
        choices = await _gather(submission)
        out = [protocol.ChatCompletionResponseChoice(
            index=index, message=protocol.ChatResponseMessage(content=self.echo + choice.text),
            logprobs=self._logprobs(choice.logprobs) if self.req.logprobs else None,
            finish_reason=choice.finish_reason, stop_reason=choice.stop_reason,
            prompt_logprobs=None if self.req.prompt_logprobs is None else _prompt_logprob_entries(
                choice.prompt_token_ids, choice.prompt_logprobs, self.req.prompt_logprobs, self.name))
            for index, choice in sorted(choices.items())]
        completion_tokens = sum(len(c.token_ids) for c in choices.values())
        return protocol.ChatCompletionResponse(id=self.id, model=self.serving.model_name, choices=out,
                                               usage=protocol.UsageInfo.of(self.prompt_tokens, completion_tokens))

    def stream(self, submission: Submission) -> AsyncIterator[str]:
        return _stream_choices(submission, self._chunk, self._final_usage, self.id)

    def _chunk(self, event: StreamEvent) -> protocol.ChatCompletionStreamResponse:
        delta = protocol.DeltaMessage(content=event.text)
        if event.prompt_token_ids is not None:  # a choice's first chunk
            delta = protocol.DeltaMessage(role="assistant", content=self.echo + event.text)
        choice = protocol.ChatCompletionResponseStreamChoice(
            index=event.tag, delta=delta, logprobs=self._logprobs(event.logprobs or []) if self.req.logprobs
            else None, finish_reason=event.finish_reason, stop_reason=event.stop_reason)
        chunk = protocol.ChatCompletionStreamResponse(id=self.id, model=self.serving.model_name, choices=[choice])
        self.generated += len(event.token_ids)
        self.sent_tokens[event.tag] = self.sent_tokens.get(event.tag, 0) + len(event.token_ids)
        if self.req.continuous_usage:
            chunk.usage = protocol.UsageInfo.of(self.prompt_tokens, self.sent_tokens[event.tag])
        return chunk

    def _final_usage(self) -> str | None:
        if not self.req.include_usage:
            return None
        return _sse_data(protocol.ChatCompletionStreamResponse(
            id=self.id, model=self.serving.model_name, choices=[],
            usage=protocol.UsageInfo.of(self.prompt_tokens, self.generated)))

    def _logprobs(self, lps: list[TokenLogprob]) -> protocol.ChatCompletionLogProbs:
        text = self.name
        return protocol.ChatCompletionLogProbs(content=[protocol.ChatCompletionLogProbsContent(
            token=text(lp.token_id), logprob=lp.logprob,
            top_logprobs=[protocol.ChatCompletionLogProb(token=text(t), logprob=v)
                          for t, v in sorted(lp.top.items(), key=lambda kv: -kv[1])]) for lp in lps])
