"""Fixtures for the HTTP tests: servers on free loopback ports over a tiny random-weight GGUF, 1 BLAS thread."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest
from threadpoolctl import threadpool_limits

from engine.core import ServerConfig
from engine.http.app import BackgroundServer
from engine.http.state import ServerOptions, ServerState
from engine.model.tiny import write_tiny_gguf


@pytest.fixture(scope="session", autouse=True)
def _one_blas_thread() -> Iterator[None]:
    """OpenBLAS spin-waits and collapses when the 2 cores are shared: tests use one thread."""
    with threadpool_limits(limits=1, user_api="blas"):
        yield


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", n_ctx_train=4096)


@pytest.fixture(scope="session")
def start_server(tiny_path: str) -> Iterator[Callable[..., BackgroundServer]]:
    """`start_server(config kwargs..., options kwargs...) -> BackgroundServer` (ready), stopped at session end."""
    running: list[BackgroundServer] = []
    option_names = set(ServerOptions.__dataclass_fields__) - {"config", "model_path"}

    def start(model_path: str | None = None, loader=None, wait: bool = True, **kw) -> BackgroundServer:
        opts = {k: kw.pop(k) for k in list(kw) if k in option_names}
        config = ServerConfig(**{"n_parallel": 4, "n_ctx": 2048, **kw})
        options = ServerOptions(model_path or tiny_path, config, n_threads=1, **opts)
        state = ServerState(options, loader) if loader is not None else ServerState(options)
        srv = BackgroundServer(state).start()
        running.append(srv)
        if wait:
            assert state.wait_ready(60), state.load_error
        return srv

    yield start
    for srv in running:
        srv.stop()


@pytest.fixture(scope="module")
def server(start_server, tmp_path_factory) -> BackgroundServer:
    """The default server: 4 slots of 512 tokens, /metrics on, slot files in a temp directory."""
    return start_server(endpoint_metrics=True, slot_save_path=str(tmp_path_factory.mktemp("slots")))


@pytest.fixture()
def client(server: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def wait_idle(client: httpx.Client, timeout_s: float = 10.0) -> list[dict]:
    """Poll /slots until no slot is processing; returns the last /slots answer."""
    import time
    t_end = time.monotonic() + timeout_s
    while True:
        slots = client.get("/slots").json()
        if not any(s["is_processing"] for s in slots) or time.monotonic() > t_end:
            return slots
        time.sleep(0.05)
