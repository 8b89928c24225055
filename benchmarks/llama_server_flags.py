"""Regenerate `experiments/data/llama_server_flags.json`: every flag llama-server accepts, read from the
`add_opt(common_arg(...))` calls in llama.cpp's `common/arg.cpp` (names, negative names, whether it takes a
value, environment variable), for the options in the server's example set (`common_params_parser_init`:
LLAMA_EXAMPLE_SERVER or LLAMA_EXAMPLE_COMMON, not excluded for the server). Only these facts are kept: no
help text, no code. Usage (the llama.cpp source comes from the llama-cpp-python sdist, docs/validation.md):

    .venv/bin/python benchmarks/llama_server_flags.py /work/ref/src/.../vendor/llama.cpp/common/arg.cpp \
        --commit 0c1e57098 > experiments/data/llama_server_flags.json
"""
import argparse
import json
import re
import sys

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("arg_cpp", help="path to llama.cpp's common/arg.cpp")
ap.add_argument("--commit", default="", help="the llama.cpp commit the file comes from (recorded in the output)")
cli = ap.parse_args()
raw = open(cli.arg_cpp).read()

def strip_comments(s):
    out = []; j = 0; n = len(s)
    while j < n:
        c = s[j]
        if s.startswith('R"(', j):
            k = s.index(')"', j); out.append(s[j:k+2]); j = k + 2; continue
        if c == '"' or c == "'":
            k = j + 1
            while s[k] != c:
                k += 2 if s[k] == "\\" else 1
            out.append(s[j:k+1]); j = k + 1; continue
        if s.startswith("//", j):
            j = s.index("\n", j); continue
        if s.startswith("/*", j):
            j = s.index("*/", j) + 2; continue
        out.append(c); j += 1
    return "".join(out)

src = strip_comments(raw)

def balanced(s, i, open_c="(", close_c=")"):
    """index after the bracket matching s[i] (== open_c), skipping string literals."""
    depth = 0; j = i
    while j < len(s):
        c = s[j]
        if c == '"':
            j += 1
            while s[j] != '"':
                j += 2 if s[j] == "\\" else 1
        elif c == "'":
            j += 1
            while s[j] != "'":
                j += 2 if s[j] == "\\" else 1
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    raise ValueError

def top_args(s):
    out = []; depth = 0; cur = ""; j = 0
    while j < len(s):
        c = s[j]
        if c == '"':
            k = j + 1
            while s[k] != '"':
                k += 2 if s[k] == "\\" else 1
            cur += s[j:k+1]; j = k + 1; continue
        if c in "([{": depth += 1
        if c in ")]}": depth -= 1
        if c == "," and depth == 0:
            out.append(cur.strip()); cur = ""
        else:
            cur += c
        j += 1
    if cur.strip(): out.append(cur.strip())
    return out

flags = []
seen = set()
for m in re.finditer(r"add_opt\(common_arg\(", src):
    start = m.end() - 1
    end = balanced(src, start)
    inner = src[start+1:end-1]
    # chain after the common_arg(...) up to the closing of add_opt
    k = end
    chain_end = balanced(src, m.start() + len("add_opt"))
    chain = src[end:chain_end]
    args = top_args(inner)
    lam = next(i for i, a in enumerate(args) if a.startswith("["))
    args = args[:lam]
    names = re.findall(r'"([^"]*)"', args[0])
    neg = []
    kind = "switch"
    if len(args) >= 3 and args[1].startswith("{"):
        neg = re.findall(r'"([^"]*)"', args[1]); kind = "bool"
    elif len(args) == 3:
        kind = "value"
    elif len(args) == 4:
        kind = "value2"
    ex = re.search(r"set_examples\(\{([^}]*)\}", chain)
    examples = [e.strip() for e in ex.group(1).split(",")] if ex else ["LLAMA_EXAMPLE_COMMON"]
    exc = re.search(r"set_excludes\(\{([^}]*)\}", chain)
    excludes = [e.strip() for e in exc.group(1).split(",")] if exc else []
    env = re.search(r'set_env\("([^"]*)"\)', chain)
    if ("LLAMA_EXAMPLE_SERVER" in examples or "LLAMA_EXAMPLE_COMMON" in examples) \
            and "LLAMA_EXAMPLE_SERVER" not in excludes and tuple(names) not in seen:
        seen.add(tuple(names))
        flags.append({"names": names, "negative": neg, "kind": kind, "env": env.group(1) if env else None})
out = {"source": "llama.cpp common/arg.cpp" + (f" at {cli.commit}" if cli.commit else ""),
       "generated_by": "benchmarks/llama_server_flags.py", "flags": flags}
json.dump(out, sys.stdout, indent=1)
print()
print(f"{len(flags)} flags", file=sys.stderr)
