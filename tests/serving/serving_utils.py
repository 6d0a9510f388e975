"""Shared set-up of the serving tests: one engine configuration for every test file (so the session's
persistent compilation cache compiles its programs once), started on loopback."""

from __future__ import annotations

import socket
import time

ENGINE_KW = dict(model="tiny", dtype="float32", dcp=2, interleave=2, page_size=4, num_pages=24, max_num_seqs=8,
                 max_model_len=64, bucket_ladder=(1, 2, 4, 8), max_num_batched_tokens=32, seed=0)


def make_engine(tmp_path_factory, **overrides):
    from dcp_jax.serving.engine import Engine

    cache = tmp_path_factory.getbasetemp() / "xla_cache"
    return Engine(**(ENGINE_KW | overrides), compilation_cache_dir=str(cache), progress=False)


def start_server(tmp_path_factory, engine=None, **kw):
    """An OpenAIServer on loopback (a free port) serving `engine` (default: a new one) from a thread."""
    from dcp_jax.serving.server import OpenAIServer

    kw = dict(uvicorn_log_level="warning", access_log=False) | kw
    server = OpenAIServer(engine or make_engine(tmp_path_factory), host="127.0.0.1", port=0, **kw)
    return server.start()


def http(server, method: str, path: str, body=None, headers=None, timeout: float = 60.0):
    """One request on its own connection: (status, headers, body bytes)."""
    import http.client
    import json

    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    try:
        conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def raw_exchange(server, request: bytes, timeout: float = 30.0) -> bytes:
    """Send raw bytes on a fresh socket, read until the server closes it (or `timeout`: a hang guard)."""
    with socket.create_connection((server.host, server.port), timeout=timeout) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data


def wait_until(condition, timeout: float = 30.0) -> bool:
    """Poll `condition()` until it holds; False after `timeout` seconds (a hang guard, never a speed check)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
