"""Sleeping on idle (`--sleep-idle-seconds`), as llama-server's `server_queue::start_loop` and
`server_context::handle_sleeping_state` (tools/server/server-queue.cpp, server-context.cpp) do it:

- after N seconds without a task the model, its KV memory, the slots and the prompt cache are dropped;
- GET /health, /props, /models and /metrics answer while asleep (from responses cached when the server fell
  asleep; /props says `is_sleeping: true`) and neither wake the model nor reset the idle timer;
- any other request wakes the model first (the request waits for the reload) and is then served as usual;
- the metrics counters survive a sleep; slotlab adds `slotlab:sleeps_total` and `slotlab:is_sleeping`.
"""

from __future__ import annotations

import time
import weakref

import httpx
import pytest

from engine.model import load
from experiments.serve import ServeError, build_parser, options_from_args, upstream_warnings
from tests.http.conftest import wait_idle

IDLE_S = 1.0        # wide enough that 'still awake right after a request' holds on a loaded machine


def wait_until(pred, timeout_s: float = 10.0) -> bool:
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


@pytest.fixture(scope="module")
def sleepy(start_server):
    return start_server(endpoint_metrics=True, sleep_idle_s=IDLE_S, n_parallel=2)


@pytest.fixture()
def sc(sleepy):
    with httpx.Client(base_url=sleepy.base_url, timeout=60) as c:
        yield c


def asleep(state) -> bool:
    return state.sleeping


def test_the_server_sleeps_after_the_idle_time_and_drops_the_model(sleepy, sc):
    body = {"prompt": "Hello the", "n_predict": 6, "ignore_eos": True, "temperature": 0}
    before = sc.post("/completion", json=body).json()
    model = weakref.ref(sleepy.state.model)
    assert wait_until(lambda: asleep(sleepy.state))
    st = sleepy.state
    assert st.model is None and st.core is None and st.backend is None and st.engine is None
    assert wait_until(lambda: model() is None)        # nothing holds the weights any more
    props = sc.get("/props").json()
    assert props["is_sleeping"] is True
    # the next task wakes the model and is served as before the sleep, from empty slots and prompt cache
    after = sc.post("/completion", json=body).json()
    assert after["content"] == before["content"]
    assert after["tokens_cached"] == after["tokens_evaluated"] + 6 - 1
    assert after["timings"]["cache_n"] == 0
    assert st.n_wakes >= 1 and st.model is not None


def test_read_only_endpoints_answer_while_asleep_without_waking(sleepy, sc):
    sc.post("/completion", json={"prompt": "a b", "n_predict": 2, "ignore_eos": True})
    assert wait_until(lambda: asleep(sleepy.state))
    n_wakes = sleepy.state.n_wakes
    for _ in range(3):
        assert sc.get("/health").json() == {"status": "ok"}
        props = sc.get("/props")
        assert props.status_code == 200 and props.json()["is_sleeping"] is True
        awake_keys = list(props.json())            # the cached /props has the shape of the awake one
        models = sc.get("/v1/models")
        assert models.status_code == 200 and models.json()["data"][0]["meta"]["n_vocab"] > 0
        m = sc.get("/metrics")
        assert m.status_code == 200 and metric(m.text, "slotlab:is_sleeping") == 1
        time.sleep(IDLE_S / 2)
    assert asleep(sleepy.state) and sleepy.state.n_wakes == n_wakes
    sc.post("/tokenize", json={"content": "x"})      # any other request wakes the model
    assert sleepy.state.n_wakes == n_wakes + 1
    live = sc.get("/props").json()
    assert list(live) == awake_keys and live["is_sleeping"] is False


def test_metrics_survive_a_sleep_and_count_it(sleepy, sc):
    sc.post("/completion", json={"prompt": "one two three", "n_predict": 3, "ignore_eos": True})
    m0 = sc.get("/metrics").text
    assert wait_until(lambda: asleep(sleepy.state))
    m1 = sc.get("/metrics").text
    for name in ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total", "llamacpp:n_decode_total"):
        assert metric(m1, name) == metric(m0, name), name
    assert metric(m1, "slotlab:sleeps_total") == metric(m0, "slotlab:sleeps_total") + 1
    assert metric(m1, "llamacpp:requests_processing") == 0
    sc.post("/completion", json={"prompt": "four", "n_predict": 2, "ignore_eos": True})
    m2 = sc.get("/metrics").text
    assert metric(m2, "llamacpp:tokens_predicted_total") == metric(m0, "llamacpp:tokens_predicted_total") + 2
    assert metric(m2, "slotlab:is_sleeping") == 0


def slow_loader(path, n_threads, numerics="f32"):
    """The tiny model with every forward call taking 50 ms more: a generation that outlasts the idle time."""
    model = load(path, n_threads, numerics=numerics)
    forward = model.forward_batch

    def slow(*a, **kw):
        time.sleep(0.05)
        return forward(*a, **kw)
    model.forward_batch = slow
    return model


def test_the_server_stays_awake_while_it_generates(start_server):
    srv = start_server(loader=slow_loader, sleep_idle_s=0.3, n_parallel=1)
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        t0 = time.monotonic()
        r = c.post("/completion", json={"prompt": "Hello", "n_predict": 20, "ignore_eos": True})
        took = time.monotonic() - t0
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 20
        assert took > 3 * 0.3                 # 20 forward calls of >= 50 ms: the generation outlasted the idle time
        assert srv.state.n_sleeps == 0        # ... and the server did not fall asleep under it
        assert wait_until(lambda: srv.state.sleeping)


def test_slots_wake_the_model_and_metrics_scrapes_do_not_reset_the_timer(sleepy, sc):
    sc.post("/tokenize", json={"content": "wake"})
    assert not asleep(sleepy.state)
    t0 = time.monotonic()
    # scraping /metrics more often than the idle time does not keep the model loaded
    while not asleep(sleepy.state) and time.monotonic() - t0 < 10:
        sc.get("/metrics")
        time.sleep(IDLE_S / 4)
    assert asleep(sleepy.state)
    n_wakes = sleepy.state.n_wakes
    assert sc.get("/slots").status_code == 200
    assert sleepy.state.n_wakes == n_wakes + 1 and not asleep(sleepy.state)


def test_disabled_by_default(server):
    assert server.state.options.sleep_idle_s == -1
    time.sleep(0.6)
    assert not server.state.sleeping


def test_cli_flag_takes_upstreams_values(tiny_path):
    p = build_parser()
    args = p.parse_args(["-m", tiny_path, "--sleep-idle-seconds", "30"])
    assert options_from_args(args).sleep_idle_s == 30
    assert not any("sleep" in w for w in upstream_warnings(args))
    assert options_from_args(p.parse_args(["-m", tiny_path])).sleep_idle_s == -1
    assert options_from_args(p.parse_args(["-m", tiny_path, "--sleep-idle-seconds", "-1"])).sleep_idle_s == -1
    for bad in ("0", "-2"):
        with pytest.raises(ServeError, match="cannot be 0 or less than -1"):
            options_from_args(p.parse_args(["-m", tiny_path, "--sleep-idle-seconds", bad]))
