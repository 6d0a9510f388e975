"""The OpenAI-compatible server's lifecycle: the socket, uvicorn, the engine's start and the drain.

`OpenAIServer(...)` binds its socket at once (ValueError for a bad host or port, before any weight is loaded or
program compiled), then serves the FastAPI app of `openai_api.py` with uvicorn: `serve_forever(load)` in the main
thread loads the engine in a worker thread meanwhile (/health answers 503 until it is ready), and on SIGTERM or
SIGINT drains: it stops accepting, lets the requests in flight finish for up to `shutdown_timeout` seconds, then
aborts the rest (each stream still ends with a final chunk and `data: [DONE]`), waits for their replies, stops the
engine and logs that every KV page is free; a second signal aborts at once. `start()` serves from a background
thread instead (tests, benchmarks), `stop()` ends it the same way. Connections are bounded by uvicorn's
`limit_concurrency` (a 503 past it) and `timeout_keep_alive`, which here also bounds the wait for a request's
head; a request body gets `body_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from dcp_jax.serving.engine import Engine
from dcp_jax.serving.openai_api import CorsOptions, OpenAIServing, build_app

log = logging.getLogger(__name__)

# The GIL's hand-over interval while serving (Python's default: 5 ms): a thread that parses, tokenizes or serializes a
# large request hands the GIL back to the engine's thread within this, so it cannot stretch another request's step.
SWITCH_INTERVAL_S = 0.0005
# How long past the shutdown timeout uvicorn waits for the aborted requests' replies before it cancels them (a
# client that stopped reading its stream).
ABORT_GRACE_S = 10


def bind_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free one); ValueError naming what is wrong."""
    if not 0 <= port <= 65535:
        raise ValueError(f"cannot listen on {host}:{port}: the port must be in [0, 65535]")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(backlog)
        except OSError:
            sock.close()
            raise
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


class _H11Protocol(H11Protocol):
    """uvicorn's h11 protocol whose keep-alive timeout also bounds the wait for a request's head: a connection that
    sends nothing, or only part of a request line and headers, is closed when it runs out (uvicorn alone waits for
    ever)."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._idle_since = self.loop.time()
        self._arm_head_timeout()

    def on_response_complete(self) -> None:
        self._idle_since = self.loop.time()
        super().on_response_complete()  # arms the keep-alive timer

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        super().data_received(data)  # disarms it
        if self.cycle is cycle and (cycle is None or cycle.response_complete):  # still no whole request head
            self._arm_head_timeout()

    def _arm_head_timeout(self) -> None:
        if self.transport.is_closing():
            return
        self._unset_keepalive_if_required()
        self.timeout_keep_alive_task = self.loop.call_at(self._idle_since + self.timeout_keep_alive,
                                                         self.timeout_keep_alive_handler)


class _Uvicorn(uvicorn.Server):
    """uvicorn with the drain: SIGTERM and SIGINT start it (and exit 0 after it, not by re-raising the signal)."""

    def __init__(self, config: uvicorn.Config, owner: OpenAIServer):
        super().__init__(config)
        self.owner = owner

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        name = signal.Signals(sig).name
        if self.should_exit:
            log.warning("%s again: aborting the requests in flight now", name)
            self.owner.loop.call_soon_threadsafe(self.owner.abort_in_flight)
            return
        log.info("%s: draining (no new connections; up to %g s for the %d requests in flight, then they are "
                 "aborted)", name, self.owner.shutdown_timeout, len(self.owner.serving.in_flight))
        self.owner.serving.is_draining = True  # a request that reaches the app from now on is a 503
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        self.owner.serving.is_draining = True
        timer = asyncio.get_running_loop().call_later(self.owner.shutdown_timeout, self.owner.abort_in_flight)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


class OpenAIServer:
    """One engine behind the OpenAI-compatible API on host:port (loopback unless told otherwise). The option names
    are vLLM's (`api_key`, `served_model_name`, `root_path`, CORS) and uvicorn's (`timeout_keep_alive`,
    `limit_concurrency`, `uvicorn_log_level`, `access_log`); `shutdown_timeout` is vLLM's (0: abort at once), as
    are `chat_template` (the template's text) and `trust_request_chat_template` (`OpenAIServing`)."""

    def __init__(self, engine: Engine | None = None, *, host: str = "127.0.0.1", port: int = 8000,
                 api_key: str | None = None, served_model_name: str | Sequence[str] | None = None,
                 cors: CorsOptions = CorsOptions(), root_path: str = "", timeout_keep_alive: float = 5.0,
                 limit_concurrency: int | None = None,
                 shutdown_timeout: float = 10.0, body_timeout_s: float = 30.0, uvicorn_log_level: str = "info",
                 access_log: bool = True, chat_template: str | None = None,
                 trust_request_chat_template: bool = False):
        if shutdown_timeout < 0:
            raise ValueError(f"{shutdown_timeout=} must be >= 0")
        self.sock = bind_socket(host, port)
        self.shutdown_timeout = shutdown_timeout
        self.serving = OpenAIServing(served_model_name=served_model_name, api_key=api_key,
                                     body_timeout_s=body_timeout_s, chat_template=chat_template,
                                     trust_request_chat_template=trust_request_chat_template)
        self.app = build_app(self.serving, cors=cors, root_path=root_path)
        config = uvicorn.Config(self.app, http=_H11Protocol, lifespan="off", timeout_keep_alive=timeout_keep_alive,
                                limit_concurrency=limit_concurrency, log_level=uvicorn_log_level,
                                access_log=access_log,
                                timeout_graceful_shutdown=int(shutdown_timeout + ABORT_GRACE_S))
        self._uvicorn = _Uvicorn(config, self)
        self._engine = engine
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._loader: threading.Thread | None = None
        self._load_error: BaseException | None = None

    @property
    def host(self) -> str:
        return self.sock.getsockname()[0]

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def engine(self) -> Engine | None:
        return self.serving.engine or self._engine

    @property
    def tokens(self):
        return self.serving.tokens

    @property
    def is_loading(self) -> bool:
        """The engine is still being built (the server stopped before it was ready)."""
        return self._loader is not None and self._loader.is_alive()

    # ---- running --------------------------------------------------------------------------------------------
    def serve_forever(self, load: Callable[[], Engine] | None = None,
                      on_ready: Callable[[Engine], None] | None = None) -> None:
        """Serve in this thread until SIGTERM or SIGINT (or `stop`), then drain and stop the engine. `load` builds
        the engine while the socket already answers (/health 503); `on_ready` runs once it serves. Raises what
        `load` raised (after the server stopped)."""
        sys.setswitchinterval(SWITCH_INTERVAL_S)  # (this thread owns the process: signals are handled here too)
        asyncio.run(self._serve(load, on_ready, stop_engine=True))
        if self._load_error is not None:
            raise self._load_error

    def start(self, timeout: float = 60.0) -> OpenAIServer:
        """Serve the engine given at construction from a background thread; returns once it answers."""
        ready = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, name="dcp-jax-http", daemon=True,
                                        args=(self._serve(None, lambda engine: ready.set(), stop_engine=False),))
        self._thread.start()
        if not ready.wait(timeout):  # (the socket listens already: connections wait in its backlog)
            raise RuntimeError(f"the server did not start within {timeout} s")
        return self

    def stop(self, *, stop_engine: bool = True) -> None:
        """End `start`'s serving (the same drain as a signal's), then stop the engine unless told not to."""
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if stop_engine and self.engine is not None:
            self.engine.stop()

    def abort_in_flight(self) -> None:
        count = self.serving.abort_all()
        if count:
            log.warning("aborting %d requests in flight: each stream ends with a final chunk and [DONE]", count)

    async def _serve(self, load, on_ready, *, stop_engine: bool) -> None:
        self.loop = asyncio.get_running_loop()
        if self._engine is not None:
            self._attach(self._engine, on_ready)
        else:
            self._loader = threading.Thread(target=self._load, args=(load, on_ready), name="dcp-jax-load",
                                            daemon=True)
            self._loader.start()
        await self._uvicorn.serve(sockets=[self.sock])
        engine = self.serving.engine
        if engine is None:
            if self.is_loading:
                log.info("stopped before the model was ready")
            return
        if stop_engine:
            await asyncio.to_thread(engine.stop)
            free, total = engine.num_free_pages, engine.num_pages
            (log.info if free == total else log.error)("stopped: %d of %d KV pages free", free, total)

    def _load(self, load: Callable[[], Engine], on_ready) -> None:
        try:
            engine = load()
        except BaseException as e:  # reported by serve_forever once uvicorn has stopped
            self._load_error = e
            self._uvicorn.should_exit = True
            return
        try:
            self.loop.call_soon_threadsafe(self._attach, engine, on_ready)
        except RuntimeError:  # the server stopped while the engine was loading
            engine.stop()

    def _attach(self, engine: Engine, on_ready) -> None:
        if self._uvicorn.should_exit:
            return
        engine.start()
        self.serving.attach(engine, self.loop)
        if on_ready is not None:
            on_ready(engine)
