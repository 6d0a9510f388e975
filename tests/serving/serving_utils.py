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


def start_server(tmp_path_factory, **kw):
    from dcp_jax.serving.server import OpenAIServer

    server = OpenAIServer(make_engine(tmp_path_factory), host="127.0.0.1", port=0, **kw)
    return server.start()


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
