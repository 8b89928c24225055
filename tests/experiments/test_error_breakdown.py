"""Errors broken down by kind, with what caused them and which knob moves it: in the summary row (one count
column per kind and one text column), run.json, and the printed summary of `slotlab simulate`."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from engine.core import ServerConfig
from engine.core.server import MSG_CTX_EXCEEDED
from experiments.cli import main
from experiments.results import ERROR_KINDS, error_breakdown, error_kind, requests_frame, summarize
from experiments.runs import format_summary

from .test_results import row


def too_long(i: int, n: int, n_ctx: int) -> dict:
    return row(i, finish="error", n_output=0, ttft_s=float("nan"), n_prompt=n,
               error=f"request ({n} tokens) exceeds the available context size ({n_ctx} tokens), try increasing it")


@pytest.mark.parametrize("message, kind", [
    ("request (9000 tokens) exceeds the available context size (8192 tokens), try increasing it", "exceed_context"),
    (MSG_CTX_EXCEEDED, "kv_full"),
    ("context shift is disabled", "context_shift_disabled"),
    ("context shift cannot be used for shared prompt", "context_shift_shared"),
    ("something new", "other"),
])
def test_each_core_message_has_its_kind(message, kind):
    assert error_kind(message) == kind
    assert kind in ERROR_KINDS


def test_slot_context_capped_by_n_ctx_train_says_so():
    cfg = ServerConfig(n_parallel=16, n_ctx=2097152, kv_unified=True, n_ctx_train=8192)
    df = requests_frame([too_long(0, 9000, 8192), too_long(1, 191000, 8192), row(2)])
    (b,) = error_breakdown(df, cfg.resolve())
    assert (b["kind"], b["count"], b["longest_prompt"]) == ("exceed_context", 2, 191000)
    assert b["text"].startswith("2 exceed the slot context (8192 tokens; longest prompt 191,000)")
    assert "n_ctx_train 8192 caps it" in b["text"] and "--n-ctx-train" in b["text"]


def test_context_split_over_slots_names_c_np_and_kvu():
    cfg = ServerConfig(n_parallel=4, n_ctx=8192)             # 2048 per slot, not capped
    (b,) = error_breakdown(requests_frame([too_long(0, 3000, 2048)]), cfg.resolve())
    assert "-c 8192 split over -np 4 slots" in b["text"]
    assert "-kvu" in b["text"] and "raise -c" in b["text"]


def test_kinds_sorted_by_count_and_unknown_messages_kept_verbatim():
    cfg = ServerConfig(n_parallel=1, n_ctx=4096).resolve()
    df = requests_frame([row(0, finish="error", error=MSG_CTX_EXCEEDED), row(1, finish="error", error="boom"),
                         row(2, finish="error", error=MSG_CTX_EXCEEDED), row(3)])
    b = error_breakdown(df, cfg)
    assert [(x["kind"], x["count"]) for x in b] == [("kv_full", 2), ("other", 1)]
    assert "boom" in b[1]["text"]


def test_summary_row_has_a_count_per_kind_and_the_text():
    df = requests_frame([too_long(0, 9000, 8192), row(1, finish="error", error=MSG_CTX_EXCEEDED), row(2)])
    s = summarize(df, sim_s=1.0, server_config=ServerConfig(n_parallel=2, n_ctx=16384, n_ctx_train=8192))
    assert s["n_errors"] == 2
    assert {k: s[f"errors_{k}"] for k in ERROR_KINDS} == {
        "exceed_context": 1, "kv_full": 1, "context_shift_disabled": 0, "context_shift_shared": 0, "other": 0}
    assert "1 exceed the slot context" in s["errors_by_kind"] and "1 ran out of KV cells" in s["errors_by_kind"]
    text = format_summary({**s, "saturated": False})
    assert "errors by kind" in text and "1 exceed the slot context (8192 tokens" in text


def test_no_errors_no_breakdown_lines():
    s = summarize(requests_frame([row(0)]), sim_s=1.0)
    assert s["errors_by_kind"] == "" and all(s[f"errors_{k}"] == 0 for k in ERROR_KINDS)
    assert "errors by kind" not in format_summary(s)


def test_simulate_prints_and_stores_the_breakdown(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": 0.01 * i, "n_prompt": n, "n_output": 4}) + "\n"
                             for i, n in enumerate([100, 5000, 200, 6000])))
    out = tmp_path / "run"
    rc = main(["simulate", "--trace", str(trace), "-np", "2", "-c", "8192", "--n-ctx-train", "4096",
               "--latency", "constant:0.01", "--out", str(out), "--no-plots"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "2 exceed the slot context (4096 tokens" in printed and "n_ctx_train 4096 caps it" not in printed
    summary = pd.read_csv(out / "summary.csv").iloc[0]
    assert summary["errors_exceed_context"] == 2 and summary["n_errors"] == 2
    assert "-c 8192 split over -np 2 slots" in summary["errors_by_kind"]
    run = json.loads((out / "run.json").read_text())
    assert [(e["kind"], e["count"], e["longest_prompt"]) for e in run["errors"]] == [("exceed_context", 2, 6000)]
