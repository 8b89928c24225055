"""Every llama-server command line starts `slotlab serve`: upstream's whole flag set (llama.cpp
common/arg.cpp, listed in experiments/data/llama_server_flags.json), its aliases and environment variables."""

from __future__ import annotations

import pytest

from experiments import upstream_flags as U
from experiments.cli import main as cli_main
from experiments.serve import ServeError, build_parser, options_from_args, upstream_warnings

ISSUE_FLAGS = ["--sleep-idle-seconds", "30", "--verbose", "--log-file", "LOG", "--tools", "all", "--media-path",
               "/tmp", "--embedding", "--reranking", "--pooling", "mean", "--lora", "a.gguf", "--jinja",
               "--no-jinja", "--reasoning-format", "none", "-ngl", "99", "-fa", "on", "-ctk", "q8_0",
               "-ctv", "q8_0", "--no-cache-idle-slots", "--model-draft", "d.gguf", "--spec-draft-n-max", "16",
               "--swa-full", "--no-ui", "--offline"]


def parse(tiny_path, *argv):
    return build_parser().parse_args(["-m", tiny_path, *argv])


def test_the_table_holds_upstreams_server_flags():
    names = {n for f in U.TABLE for n in (*f.names, *f.negative)}
    assert len(U.TABLE) > 200
    for n in ("-ngl", "--n-gpu-layers", "-fa", "--flash-attn", "--jinja", "--no-jinja", "--sleep-idle-seconds",
              "--chat-template-file", "-cram", "--cache-ram", "-kvu", "--cors-origins", "--slot-save-path"):
        assert n in names, n


def test_every_upstream_flag_parses(tiny_path, tmp_path):
    argv = []
    for f in U.TABLE:
        name = next((n for n in f.names if n.startswith("--")), f.names[0])
        if set(f.names) & (U.ACTIONS | U.DOWNLOADS | {"--model"}):
            continue
        argv += {"value": [name, "1"], "value2": [name, "1", "2"]}.get(f.kind, [name])
    args = parse(tiny_path, *argv)                           # argparse consumes every value with its flag
    assert args.model == tiny_path


def test_the_issues_command_line_starts_with_one_warning_per_flag_that_does_nothing(tiny_path, tmp_path):
    argv = [str(tmp_path / a) if a == "LOG" else a for a in ISSUE_FLAGS]
    args = parse(tiny_path, *argv)
    opts = options_from_args(args)
    assert opts.config.cache_idle_slots is False              # implemented: slotlab's own flag
    warnings = upstream_warnings(args)
    text = "\n".join(warnings)
    for flag in ("--gpu-layers 99", "--flash-attn on", "--cache-type-k q8_0", "--lora a.gguf", "--embedding",
                 "--spec-draft-model d.gguf", "--no-jinja"):
        assert flag in text, (flag, text)
    assert not any(w.startswith(("--verbose", "--log-file", "--jinja:", "--sleep-idle-seconds")) for w in warnings)
    assert len(warnings) == len(set(warnings))


def test_upstream_aliases_of_slotlab_flags_set_the_same_option(tiny_path):
    assert parse(tiny_path, "--temperature", "0.25").temp == 0.25
    assert options_from_args(parse(tiny_path, "--temperature", "0.25")).default_sampling.temperature == 0.25


def test_environment_variables_give_values_the_command_line_does_not(tiny_path):
    env = {"LLAMA_ARG_N_PARALLEL": "3", "LLAMA_ARG_CTX_SIZE": "2048", "LLAMA_ARG_CONT_BATCHING": "0",
           "LLAMA_ARG_ENDPOINT_METRICS": "1", "LLAMA_ARG_N_GPU_LAYERS": "99"}
    argv = U.env_argv(["-m", tiny_path, "-c", "4096"], env)
    args = build_parser().parse_args(argv)
    opts = options_from_args(args)
    assert opts.config.n_parallel == 3 and opts.config.n_ctx == 4096          # the command line wins
    assert opts.config.cont_batching is False and opts.endpoint_metrics
    assert U.value_of(args, "-ngl") == "99"


def test_model_downloads_are_refused_clearly(tiny_path):
    with pytest.raises(ServeError, match="-hf.*cannot be downloaded here; pass a local GGUF file with -m"):
        options_from_args(parse(tiny_path, "-hf", "org/model"))


def test_chat_template_from_flag_or_file(tiny_path, tmp_path):
    t = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    assert options_from_args(parse(tiny_path, "--chat-template", t)).chat_template == t
    f = tmp_path / "t.jinja"
    f.write_text(t)
    assert options_from_args(parse(tiny_path, "--chat-template-file", str(f))).chat_template == t
    with pytest.raises(ServeError, match="built-in template names are not available"):
        options_from_args(parse(tiny_path, "--chat-template", "chatml"))
    with pytest.raises(ServeError, match="--chat-template-file .*missing"):
        options_from_args(parse(tiny_path, "--chat-template-file", str(tmp_path / "missing")))


def test_the_chat_template_flag_renders_chats(start_server, tiny_path):
    import httpx
    t = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    srv = start_server(chat_template=t)
    r = httpx.post(srv.base_url + "/apply-template", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.json()["prompt"] == "[user]hi"


def test_slotlab_serve_reads_the_environment_too(monkeypatch, tiny_path, capsys):
    monkeypatch.setenv("LLAMA_ARG_MODEL", "/nonexistent/model.gguf")
    assert cli_main(["serve", "--port", "1"]) == 1
    assert "model file not found: /nonexistent/model.gguf" in capsys.readouterr().err


def test_cors_flags_reach_the_server_options(tiny_path):
    opts = options_from_args(parse(tiny_path, "--cors-origins", "localhost", "--cors-methods", "GET",
                                   "--cors-headers", "X-A", "--no-cors-credentials"))
    assert (opts.cors_origins, opts.cors_methods, opts.cors_headers, opts.cors_credentials) == \
        ("localhost", "GET", "X-A", False)
    assert not upstream_warnings(parse(tiny_path, "--cors-methods", "GET"))      # implemented, no warning


def test_verbose_server_adds_the_debug_field_to_openai_responses(start_server, tiny_path):
    import httpx
    assert options_from_args(parse(tiny_path, "--verbose")).verbose
    srv = start_server(verbose=True)
    with httpx.Client(base_url=srv.base_url, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).json()
        assert r["__verbose"]["tokens_predicted"] == 2 and "generation_settings" in r["__verbose"]
        assert "__verbose" not in c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2,
                                                                   "verbose": False}).json()
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                    "max_tokens": 1}).json()
        assert "content" in chat["__verbose"]
