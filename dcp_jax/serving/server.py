"""OpenAI-compatible HTTP server over an `Engine` (stdlib `http.server`, one thread per connection).

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both with SSE `stream`),
POST /tokenize, POST /detokenize, GET /tokenizer_info, GET /health, GET /metrics (Prometheus text).
Every request body is parsed and validated (`protocol.py`, `Engine.validate`) before anything is queued; a bad
one gets a 400 with an OpenAI-shaped `{"error": {...}}`; a stopped engine gets a 503. A client that goes away
aborts its requests, so their KV pages return to the pool: a streaming one at the next write, a waiting
non-streaming one within DISCONNECT_POLL_S. Binds loopback unless told otherwise; `api_key` guards /v1/*.
The `dcp-jax serve` command that builds and runs one lives in `cli.py`.
"""

from __future__ import annotations

import json
import logging
import queue
import select
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from dcp_jax.serving import protocol
from dcp_jax.host.sampling import TokenLogprob
from dcp_jax.serving.engine import Engine, EngineStoppedError
from dcp_jax.serving.streams import StreamEvent
from dcp_jax.serving.protocol import ProtocolError, TokenizerView

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20
# How long a non-streaming request may wait for its tokens before the server gives up on it.
REQUEST_TIMEOUT_S = 600.0
# How often a non-streaming request checks whether its client is still connected.
DISCONNECT_POLL_S = 0.25


class _Choice:
    """The events of one choice gathered for a non-streaming reply."""

    def __init__(self):
        self.token_ids, self.text, self.logprobs = [], "", []
        self.prompt_ids, self.prompt_logprobs, self.finish_reason, self.error = None, None, None, None

    def add(self, event: StreamEvent) -> None:
        if event.prompt_token_ids is not None:
            self.prompt_ids, self.prompt_logprobs = event.prompt_token_ids, event.prompt_logprobs
        self.token_ids += event.token_ids
        self.text += event.text
        self.logprobs += event.logprobs or []
        self.finish_reason, self.error = event.finish_reason, event.error


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    # The stdlib's listen backlog of 5 resets bursts of concurrent clients; allow a burst of hundreds.
    request_queue_size = 512


class OpenAIServer:
    """Owns the HTTP server and the engine's thread; `serve_forever` or `start` (background) then `stop`."""

    def __init__(self, engine: Engine, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                 served_model_name: str | None = None):
        self.engine = engine
        self.api_key = api_key
        self.model_name = served_model_name or engine.model_name
        self.tokens = TokenizerView(engine.tokenizer, bos_token_id=engine.model_config.bos_token_id,
                                    eos_token_id=engine.model_config.eos_token_id)
        self.created = int(time.time())
        handler = type("Handler", (_Handler,), {"app": self})
        self.httpd = _HTTPServer((host, port), handler)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self.httpd.server_address[0]}:{self.port}"

    def start(self) -> OpenAIServer:
        self.engine.start()
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="dcp-jax-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.engine.start()
        try:
            self.httpd.serve_forever()
        finally:
            self.stop()

    def stop(self, *, stop_engine: bool = True) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
            self._thread = None
        self.httpd.server_close()
        if stop_engine:
            self.engine.stop()

    # ---- request -> engine --------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ProtocolError(f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                                "model", status=404, type="NotFoundError", code="model_not_found")

    def submit(self, prompts: list[list[int]], params, n: int, *, prompt_logprobs: int | None):
        """Validate every choice, then queue them all: (sink, request ids), choice index = prompt * n + j."""
        for i, ids in enumerate(prompts):
            try:
                self.engine.validate(ids, params, prompt_logprobs)
            except ValueError as e:
                raise ProtocolError(f"prompt {i}: {e}" if len(prompts) > 1 else str(e), "prompt") from None
        sink: queue.Queue = queue.Queue()
        ids_out = []
        try:
            for i, ids in enumerate(prompts):
                for j in range(n):
                    p = params if params.seed is None or j == 0 else _with_seed(params, params.seed + j)
                    ids_out.append(self.engine.add_request(ids, p, sink, tag=i * n + j,
                                                           prompt_logprobs=prompt_logprobs))
        except EngineStoppedError as e:
            self.abort(ids_out)
            raise ProtocolError(f"{e}: the server cannot take requests", status=503,
                                type="service_unavailable") from None
        return sink, ids_out

    def abort(self, request_ids) -> None:
        for rid in request_ids:
            self.engine.abort(rid)


def _with_seed(params, seed):
    import dataclasses

    return dataclasses.replace(params, seed=seed % 2**63)


class _Handler(BaseHTTPRequestHandler):
    app: OpenAIServer
    protocol_version = "HTTP/1.1"
    server_version = "dcp-jax"

    def log_message(self, format, *args):  # quiet: the access log goes to the debug logger
        log.debug("%s - %s", self.address_string(), format % args)

    # ---- plumbing -----------------------------------------------------------------------------------------
    def _send_json(self, status: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_text(self, status: int, text: str, content_type: str) -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _read_body(self) -> None:
        """Read the whole body before routing, so an early error reply leaves the connection clean."""
        self._body = b""
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self.close_connection = True
            raise ProtocolError("bad Content-Length") from None
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            raise ProtocolError(f"request body over {MAX_BODY_BYTES} bytes", status=413)
        self._body = self.rfile.read(length) if length > 0 else b""

    def _read_json(self):
        try:
            return json.loads(self._body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ProtocolError(f"the body is not valid JSON: {e}") from None

    def _authorized(self) -> bool:
        if self.app.api_key is None or not self.path.startswith("/v1"):
            return True
        return self.headers.get("Authorization", "") == f"Bearer {self.app.api_key}"

    def _dispatch(self, routes: dict) -> None:
        path = self.path.split("?", 1)[0]
        try:
            if self.command == "POST":
                self._read_body()
            if not self._authorized():
                raise ProtocolError("invalid API key", status=401, type="authentication_error",
                                    code="invalid_api_key")
            route = routes.get(path)
            if route is None:
                other = _POST if routes is _GET else _GET
                if path in other:
                    raise ProtocolError(f"method {self.command} not allowed on {path}", status=405)
                raise ProtocolError(f"no route {path}", status=404, type="NotFoundError")
            route(self)
        except ProtocolError as e:
            self._send_json(e.status, e.body())
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # a bug answering this request fails this request only
            log.exception("%s %s failed", self.command, path)
            try:
                self._send_json(500, ProtocolError(f"internal error: {e}", status=500, type="server_error").body())
            except OSError:
                self.close_connection = True

    def do_GET(self):
        self._dispatch(_GET)

    def do_POST(self):
        self._dispatch(_POST)

    # ---- simple endpoints ---------------------------------------------------------------------------------
    def health(self):
        ok = self.app.engine.is_alive
        self._send_json(200 if ok else 503, {"status": "ok" if ok else "engine stopped"})

    def metrics(self):
        self._send_text(200, self.app.engine.metrics.render(), "text/plain; version=0.0.4; charset=utf-8")

    def models(self):
        app = self.app
        self._send_json(200, {"object": "list", "data": [{
            "id": app.model_name, "object": "model", "created": app.created, "owned_by": "dcp-jax",
            "max_model_len": app.engine.engine_config.max_model_len}]})

    def tokenizer_info(self):
        tokens, engine = self.app.tokens, self.app.engine
        self._send_json(200, {
            "tokenizer_class": type(engine.tokenizer).__name__,
            "bos_token": tokens.special_name(tokens.bos_token_id),
            "eos_token": tokens.special_name(tokens.eos_token_id), "pad_token": None,
            "chat_template": protocol.CHAT_TEMPLATE,
            "model_max_length": engine.engine_config.max_model_len, "vocab_size": engine.model_config.vocab_size})

    def tokenize(self):
        body = self._read_json()
        if not isinstance(body, dict):
            raise ProtocolError("the body must be a JSON object")
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise ProtocolError("'add_special_tokens' must be a bool", "add_special_tokens")
        if "messages" in body:
            chat = protocol.parse_chat({"messages": body["messages"]})
            text = protocol.apply_chat_template(chat.messages, bool(body.get("add_generation_prompt", True)))
        else:
            text = body.get("prompt")
            if not isinstance(text, str):
                raise ProtocolError("'prompt' must be a string", "prompt")
        ids = self.app.tokens.encode(text, add_special_tokens=add_special)
        self._send_json(200, {"tokens": ids, "count": len(ids),
                              "max_model_len": self.app.engine.engine_config.max_model_len})

    def detokenize(self):
        body = self._read_json()
        ids = body.get("tokens") if isinstance(body, dict) else None
        vocab = self.app.engine.model_config.vocab_size
        if not isinstance(ids, list) or not all(protocol._is_int(t) and 0 <= t < vocab for t in ids):
            raise ProtocolError(f"'tokens' must be a list of token ids in [0, {vocab})", "tokens")
        self._send_json(200, {"prompt": self.app.tokens.decode(ids)})

    # ---- completions --------------------------------------------------------------------------------------
    def completions(self):
        app = self.app
        req = protocol.parse_completion(self._read_json())
        app.check_model(req.model)
        prompts = [list(p) if isinstance(p, tuple) else app.tokens.encode(p) for p in req.prompts]
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        sink, rids = app.submit(prompts, req.params, req.n, prompt_logprobs=prompt_logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            self._stream(sink, rids, lambda ev, c: self._completion_chunk(rid, req, prompts, ev, c),
                         sum(len(p) for p in prompts), req.include_usage, rid, "text_completion")
            return
        choices = self._collect(sink, rids)
        out = []
        for index, choice in sorted(choices.items()):
            prompt = prompts[index // req.n]
            echo = app.tokens.decode(prompt) if req.echo else ""
            text = echo + choice.text
            logprobs = None
            if req.logprobs is not None:
                logprobs = self._completion_logprobs(prompt if req.echo else [], choice.prompt_logprobs,
                                                     choice.logprobs, base=len(echo), end=len(text))
            out.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": choice.finish_reason})
        completion_tokens = sum(len(c.token_ids) for c in choices.values())
        prompt_tokens = sum(len(p) for p in prompts)  # each prompt once, whatever n (vLLM's usage)
        self._send_json(200, {"id": rid, "object": "text_completion", "created": int(time.time()),
                              "model": app.model_name, "choices": out,
                              "usage": _usage(prompt_tokens, completion_tokens)})

    def _completion_logprobs(self, echoed: list[int], prompt_lps, lps: list[TokenLogprob], *, base: int,
                             end: int | None) -> dict:
        """OpenAI `logprobs` of the echoed prompt tokens, then the generated ones. `text_offset` indexes the
        choice's returned text: echoed token i starts at len(decode(echoed[:i])) (BOS has no text), a generated
        token at `base` (the echoed text's length) + where it starts in the generated text, clamped to `end` (the
        text's length once known: a stop string may have cut the text before the last tokens)."""
        tokens = self.app.tokens
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offsets = tokens.text_offsets(echoed) + [base + lp.text_offset for lp in lps]
        entries = list(zip(echoed, prompt_lps or [None] * len(echoed))) + [(lp.token_id, lp) for lp in lps]
        for (token_id, lp), offset in zip(entries, offsets):
            out["tokens"].append(tokens.token_text(token_id))
            out["token_logprobs"].append(None if lp is None else lp.logprob)
            out["top_logprobs"].append(None if lp is None else {tokens.token_text(t): v for t, v in lp.top.items()})
            out["text_offset"].append(offset if end is None else min(offset, end))
        return out

    def _completion_chunk(self, rid, req, prompts, event: StreamEvent, state: dict) -> dict:
        """One choice's delta; `state[index]` carries the choice's text length so far (the echo included), so
        text_offset stays an index into the whole streamed text."""
        index = event.tag
        text = event.text
        lps = event.logprobs or []
        echoed = []
        if req.echo and event.prompt_token_ids is not None:
            echoed = prompts[index // req.n]
            text = self.app.tokens.decode(echoed) + text
        choice = state.setdefault(index, {"base": len(text) - len(event.text), "sent": 0})
        choice["sent"] += len(text)
        logprobs = None
        if req.logprobs is not None:
            end = choice["sent"] if event.finish_reason is not None else None
            logprobs = self._completion_logprobs(echoed, event.prompt_logprobs, lps, base=choice["base"], end=end)
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.app.model_name,
                "choices": [{"index": index, "text": text, "logprobs": logprobs,
                             "finish_reason": event.finish_reason}]}

    # ---- chat ---------------------------------------------------------------------------------------------
    def chat_completions(self):
        app = self.app
        req = protocol.parse_chat(self._read_json())
        app.check_model(req.model)
        prompt = app.tokens.encode(protocol.apply_chat_template(req.messages), add_special_tokens=True)
        sink, rids = app.submit([prompt], req.params, req.n, prompt_logprobs=None)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            self._stream(sink, rids, lambda ev, c: self._chat_chunk(rid, req, ev, c), len(prompt), req.include_usage,
                         rid, "chat.completion.chunk")
            return
        choices = self._collect(sink, rids)
        out = [{"index": i, "message": {"role": "assistant", "content": c.text},
                "logprobs": self._chat_logprobs(c.logprobs) if req.logprobs else None,
                "finish_reason": c.finish_reason} for i, c in sorted(choices.items())]
        completion_tokens = sum(len(c.token_ids) for c in choices.values())
        self._send_json(200, {"id": rid, "object": "chat.completion", "created": int(time.time()),
                              "model": app.model_name, "choices": out,
                              "usage": _usage(len(prompt), completion_tokens)})

    def _chat_logprobs(self, lps: list[TokenLogprob]) -> dict:
        text = self.app.tokens.token_text
        return {"content": [{"token": text(lp.token_id), "logprob": lp.logprob, "bytes": None,
                             "top_logprobs": [{"token": text(t), "logprob": v, "bytes": None}
                                              for t, v in sorted(lp.top.items(), key=lambda kv: -kv[1])]}
                            for lp in lps]}

    def _chat_chunk(self, rid, req, event: StreamEvent, state: dict) -> dict:
        delta = {"content": event.text}
        if event.tag not in state:
            state[event.tag] = True
            delta["role"] = "assistant"
        return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.app.model_name,
                "choices": [{"index": event.tag, "delta": delta,
                             "logprobs": self._chat_logprobs(event.logprobs or []) if req.logprobs else None,
                             "finish_reason": event.finish_reason}]}

    # ---- shared: collect or stream ------------------------------------------------------------------------
    def _collect(self, sink: queue.Queue, rids: list[str]) -> dict[int, _Choice]:
        """Every choice's events; aborts them when the client disconnects (checked every DISCONNECT_POLL_S) or
        REQUEST_TIMEOUT_S passes."""
        choices = {}
        live = len(rids)
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        next_check = time.monotonic() + DISCONNECT_POLL_S
        while live:
            try:
                event = sink.get(timeout=DISCONNECT_POLL_S)
            except queue.Empty:
                event = None
            now = time.monotonic()
            if now >= next_check:  # events may keep coming: check by the clock, not only when none came
                next_check = now + DISCONNECT_POLL_S
                if self._client_gone():
                    self.app.abort(rids)
                    self.close_connection = True
                    raise ConnectionResetError("the client disconnected")
            if event is None:
                if now > deadline:
                    self.app.abort(rids)
                    raise ProtocolError("the request timed out", status=504, type="timeout")
                continue
            choice = choices.setdefault(event.tag, _Choice())
            choice.add(event)
            if event.finish_reason is not None:
                live -= 1
        errors = [c.error for c in choices.values() if c.finish_reason == "error"]
        if errors:
            self.app.abort(rids)
            raise ProtocolError(f"generation failed: {errors[0]}", status=500, type="server_error")
        if any(c.finish_reason == "abort" for c in choices.values()):  # only the engine stopping aborts these
            raise ProtocolError("the engine stopped before the request finished", status=503,
                                type="service_unavailable")
        return choices

    def _client_gone(self) -> bool:
        """The client closed its end (readable with nothing to read) or the socket failed."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _stream(self, sink: queue.Queue, rids: list[str], chunk, prompt_tokens: int, include_usage: bool, rid: str,
                obj: str) -> None:
        """Stream the choices' chunks, then the usage (the prompts' tokens once, whatever n) when asked."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        live, state = len(rids), {}
        completion_tokens = 0
        # From here on the reply is an event stream: nothing may write a JSON error reply into it.
        try:
            while live:
                event = sink.get(timeout=REQUEST_TIMEOUT_S)
                completion_tokens += len(event.token_ids)
                if event.finish_reason is not None:
                    live -= 1
                if event.finish_reason == "error":
                    self._sse({"error": {"message": f"generation failed: {event.error}", "type": "server_error",
                                         "param": None, "code": None}})
                    self.app.abort(rids)
                    return
                self._sse(chunk(event, state))
            if include_usage:
                self._sse({"id": rid, "object": obj, "created": int(time.time()), "model": self.app.model_name,
                           "choices": [], "usage": _usage(prompt_tokens, completion_tokens)})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, queue.Empty, OSError):
            # The client went away (or nothing came for too long): free the requests' pages now.
            self.app.abort(rids)
        except Exception:  # a bug while streaming: end this stream (no [DONE]) and free its requests' pages
            log.exception("streaming %s failed", rid)
            self.app.abort(rids)

    def _sse(self, body: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(body).encode() + b"\n\n")
        self.wfile.flush()


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


_GET = {"/health": _Handler.health, "/metrics": _Handler.metrics, "/v1/models": _Handler.models,
        "/tokenizer_info": _Handler.tokenizer_info}
_POST = {"/v1/completions": _Handler.completions, "/v1/chat/completions": _Handler.chat_completions,
         "/tokenize": _Handler.tokenize, "/detokenize": _Handler.detokenize}

