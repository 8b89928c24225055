"""The warm-up run at load (`--warmup`, on by default, as llama.cpp's `common_init_from_params`; `--no-warmup`
skips it): an empty run before the server reports ready, on a scratch KV store, leaving no trace in the slots or
the metrics."""

from __future__ import annotations

import logging

import httpx
import numpy as np

from engine.model import load
from experiments.serve import build_parser, options_from_args, upstream_warnings


def counting_loader(calls: list[int]):
    def loader(path, n_threads, numerics="f32"):
        model = load(path, n_threads, numerics=numerics)
        warm = model.warm_up

        def counted() -> float:
            calls.append(1)
            return warm()
        model.warm_up = counted
        return model
    return loader


def test_the_server_warms_up_before_it_is_ready_and_logs_it(start_server, caplog):
    calls: list[int] = []
    with caplog.at_level(logging.INFO, logger="slotlab.server"):
        srv = start_server(loader=counting_loader(calls), endpoint_metrics=True)
    assert calls == [1]
    assert any("warm-up done in" in r.getMessage() for r in caplog.records)
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        metrics = c.get("/metrics").text
        assert "llamacpp:prompt_tokens_total 0" in metrics and "llamacpp:tokens_predicted_total 0" in metrics
        slots = c.get("/slots").json()
        assert all("id_task" not in s and not s["is_processing"] for s in slots)   # no slot ever held a task
        r = c.post("/completion", json={"prompt": "hello", "n_predict": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 3


def test_no_warmup_skips_it(start_server):
    calls: list[int] = []
    start_server(loader=counting_loader(calls), warmup=False)
    assert calls == []


def test_the_warm_up_leaves_the_model_as_it_was(tiny_path):
    from engine.model import BatchChunk
    model = load(tiny_path, 1)
    kv = model.new_kv(1, 16)
    want = model.forward_batch(kv, [BatchChunk(0, [5, 6, 7], 0, True)])[0]
    assert model.warm_up() > 0
    kv = model.new_kv(1, 16)
    assert np.array_equal(model.forward_batch(kv, [BatchChunk(0, [5, 6, 7], 0, True)])[0], want)


def test_cli_warmup_flags_are_implemented_without_a_warning(tiny_path):
    p = build_parser()
    assert options_from_args(p.parse_args(["-m", tiny_path])).warmup is True
    assert options_from_args(p.parse_args(["-m", tiny_path, "--warmup"])).warmup is True
    args = p.parse_args(["-m", tiny_path, "--no-warmup"])
    assert options_from_args(args).warmup is False
    assert not any("warmup" in w for w in upstream_warnings(args))
