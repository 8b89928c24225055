"""The server logs slot and prompt-cache decisions in llama-server's wording (engine/http/server_log.py)."""

from __future__ import annotations

import logging

import httpx

from engine.http.server_log import ServerLog


def test_slot_selection_and_cache_events_are_logged_as_upstream(start_server, caplog):
    srv = start_server(n_parallel=1, n_ctx=512, cache_ram_mib=1)
    with caplog.at_level(logging.DEBUG, logger="slotlab.server"), \
            httpx.Client(base_url=srv.base_url, timeout=30) as c:
        c.post("/completion", json={"prompt": "alpha beta gamma delta", "n_predict": 2})
        c.post("/completion", json={"prompt": "something completely different here", "n_predict": 2})
        c.post("/completion", json={"prompt": "alpha beta gamma delta", "n_predict": 2, "id_slot": 0})
    lines = [r.getMessage() for r in caplog.records if r.name == "slotlab.server"]
    text = "\n".join(lines)
    assert "slot get_availabl: id  0 | task 0 | selected slot by LRU, t_last = -1" in text
    assert "selected slot by id (0)" in text
    assert "srv   prompt_save:  - saving prompt with length" in text
    assert "processing task, is_child = 0" in text


def test_eviction_and_purge_wording():
    got = []
    handler = logging.Handler()
    handler.emit = lambda r: got.append(r.getMessage())
    logger = logging.getLogger("slotlab.server")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        rec = ServerLog(lambda n: n * 1024 * 1024, 0.1, 8 * 1024 * 1024)
        rec.record(0.0, "cache_save", slot=0, entry=7, n_tokens=3, cache_bytes=3 * 1024 * 1024, n_entries=1)
        rec.record(0.0, "cache_drop", entry=7, n_tokens=3, reason="evict_size_limit")
        rec.record(0.0, "purge_idle_slot", slot=2, n_tokens=40)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    assert "srv        update:  - cache size limit reached, removing oldest entry (size = 3.000 MiB)" in got
    assert "srv  try_clear_id: purging slot 2 with 40 tokens" in got
