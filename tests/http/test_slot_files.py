"""POST /slots/{id}?action=save|restore|erase: files under --slot-save-path, filename checks, corrupt files."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tests.http.conftest import wait_idle

PROMPT = "the cat is on the house and of the"


def test_save_erase_restore_round_trip_then_the_prompt_is_reused(client, server):
    first = client.post("/completion", json={"prompt": PROMPT, "n_predict": 4, "id_slot": 2, "ignore_eos": True,
                                             "temperature": 0}).json()
    n_saved = first["tokens_evaluated"] + 4 - 1
    save = client.post("/slots/2?action=save", json={"filename": "s2.bin"}).json()
    assert list(save) == ["id_slot", "filename", "n_saved", "n_written", "timings"]
    assert save["id_slot"] == 2 and save["n_saved"] == n_saved and list(save["timings"]) == ["save_ms"]
    path = os.path.join(server.state.options.slot_save_path, "s2.bin")
    assert os.path.getsize(path) == save["n_written"]
    erase = client.post("/slots/2?action=erase").json()
    assert erase == {"id_slot": 2, "n_erased": n_saved}
    restore = client.post("/slots/2?action=restore", json={"filename": "s2.bin"}).json()
    assert list(restore) == ["id_slot", "filename", "n_restored", "n_read", "timings"]
    assert restore["n_restored"] == n_saved and restore["n_read"] == save["n_written"]
    again = client.post("/completion", json={"prompt": PROMPT, "n_predict": 4, "id_slot": 2, "ignore_eos": True,
                                             "temperature": 0}).json()
    assert again["timings"]["cache_n"] == first["tokens_evaluated"] - 1
    assert again["content"] == first["content"]


def test_restore_into_another_slot_and_slot_ids_wrap_around(client):
    client.post("/completion", json={"prompt": PROMPT, "n_predict": 2, "id_slot": 0})
    client.post("/slots/0?action=save", json={"filename": "s0.bin"})
    r = client.post("/slots/5?action=restore", json={"filename": "s0.bin"}).json()   # 5 % 4 slots = 1
    assert r["id_slot"] == 1


@pytest.mark.parametrize("name", ["../x.bin", "a/b.bin", "/etc/passwd", "", "..", "a\x01b", "a\\b", " x",
                                  "x" * 300, 5])
def test_bad_filenames_are_400_invalid_filename(client, name):
    for action in ("save", "restore"):
        r = client.post(f"/slots/0?action={action}", json={"filename": name})
        assert r.status_code == 400 and r.json()["error"]["message"] == "Invalid filename"


def test_bad_slot_id_action_and_missing_filename(client):
    assert client.post("/slots/abc?action=erase").json()["error"]["message"] == "Invalid slot ID"
    assert client.post("/slots/-1?action=erase").json()["error"]["message"] == "Invalid slot ID"
    assert client.post("/slots/0?action=fly", json={}).json()["error"]["message"] == "Invalid action"
    r = client.post("/slots/0?action=save", json={})
    assert r.status_code == 500                   # upstream: json.at("filename") throws -> 500


@pytest.mark.parametrize("damage", ["truncate", "magic", "garbage", "missing"])
def test_corrupt_or_missing_file_is_400_and_leaves_the_slot_clean(client, server, damage):
    client.post("/completion", json={"prompt": PROMPT, "n_predict": 2, "id_slot": 3})
    client.post("/slots/3?action=save", json={"filename": "good.bin"})
    path = os.path.join(server.state.options.slot_save_path, "bad.bin")
    data = open(os.path.join(server.state.options.slot_save_path, "good.bin"), "rb").read()
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "magic":
        data = b"XXXX" + data[4:]
    elif damage == "garbage":
        data = data[:40] + os.urandom(len(data) - 40)
    if damage == "missing":
        if os.path.exists(path):
            os.remove(path)
    else:
        with open(path, "wb") as f:
            f.write(data)
    r = client.post("/slots/3?action=restore", json={"filename": "bad.bin"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("Unable to restore slot: ")
    assert client.post("/slots/3?action=erase").json()["n_erased"] == 0       # the slot was cleared
    assert server.state.backend.kv.n_tokens(3) == 0


def test_action_on_a_busy_slot_waits_until_it_is_released(client, server):
    done = {}

    def long_request():
        done["r"] = client.post("/completion", json={"prompt": "Hello", "n_predict": 300, "id_slot": 1,
                                                     "ignore_eos": True}).json()

    th = threading.Thread(target=long_request)
    th.start()
    t_end = time.monotonic() + 5
    while not server.state.core.slots[1].is_processing:
        assert time.monotonic() < t_end
        time.sleep(0.005)
    save = client.post("/slots/1?action=save", json={"filename": "busy.bin"}).json()
    th.join()
    assert save["n_saved"] == done["r"]["tokens_cached"]      # saved after the request finished
    wait_idle(client)
