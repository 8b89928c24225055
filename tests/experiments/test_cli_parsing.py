"""`slotlab simulate` flags: llama-server names and defaults mapped onto ServerConfig; clear usage errors."""

from __future__ import annotations

import pytest

from engine.core import PolicyNames, ServerConfig
from experiments.cli import build_parser, main
from experiments.flags import OPTIONS, simulate_argv
from experiments.runs import default_kv_bytes, server_config
from policies import BATCH_BUILDERS, CONTEXT_SHIFTS, EVICTIONS, QUEUE_ORDERS, SLOT_SELECTORS
from sim.latency_spec import get_latency_model


def values_of(*argv: str) -> dict:
    args = build_parser().parse_args(["simulate", *argv])
    return {o.dest: getattr(args, o.dest) for o in OPTIONS}


def config_of(*argv: str) -> ServerConfig:
    return server_config(values_of(*argv))


def test_no_flags_give_upstream_defaults_with_smollm2_model_facts():
    assert config_of() == ServerConfig(n_ctx_train=8192, kv_bytes_per_token=23052)


def test_llama_server_short_flags_map_onto_server_config_fields():
    cfg = config_of("-np", "8", "-c", "16384", "-b", "1024", "-ub", "256", "-cram", "0", "-sps", "0.5",
                    "--cache-reuse", "64", "--context-shift", "--keep", "-1", "-kvu", "--no-cache-idle-slots",
                    "--no-cache-prompt", "-nocb", "-n", "128")
    assert (cfg.n_parallel, cfg.n_ctx, cfg.n_batch, cfg.n_ubatch, cfg.cache_ram_mib) == (8, 16384, 1024, 256, 0)
    assert (cfg.slot_prompt_similarity, cfg.n_cache_reuse, cfg.ctx_shift, cfg.n_keep) == (0.5, 64, True, -1)
    assert (cfg.kv_unified, cfg.cache_idle_slots, cfg.cache_prompt, cfg.cont_batching, cfg.n_predict) == \
        (True, False, False, False, 128)


def test_long_flags_are_equivalent_to_short_flags():
    short = config_of("-np", "2", "-c", "4096", "-b", "512", "-ub", "128", "-cram", "-1", "-sps", "0.2", "-n", "7")
    long = config_of("--parallel", "2", "--ctx-size", "4096", "--batch-size", "512", "--ubatch-size", "128",
                     "--cache-ram", "-1", "--slot-prompt-similarity", "0.2", "--predict", "7")
    assert short == long


def test_no_kvu_forces_separate_kv_buffers_and_default_is_auto():
    assert config_of("-no-kvu").kv_unified is False
    assert config_of().kv_unified is None


def test_policy_flags_select_registry_policies_and_cache_hit_mode():
    cfg = config_of("--select", "lru", "--queue", "shortest_prompt", "--batch", "token_budget:512",
                    "--shift", "sink_window", "--evict", "gdsf", "--cache-hit", "copy")
    assert cfg.policies == PolicyNames("lru", "shortest_prompt", "token_budget:512", "sink_window", "gdsf")
    assert cfg.cache_hit == "copy"


def test_kv_bytes_default_follows_the_roofline_model_spec():
    latency = get_latency_model("roofline:llama-3-8b@a100-80gb")
    assert server_config(values_of(), latency).kv_bytes_per_token == default_kv_bytes(latency) == 131072
    assert server_config(values_of("--kv-bytes-per-token", "1000"), latency).kv_bytes_per_token == 1000


def test_help_lists_every_registered_policy_and_three_examples(capsys):
    assert main(["simulate", "--help"]) == 0
    text = capsys.readouterr().out
    for registry in (SLOT_SELECTORS, QUEUE_ORDERS, BATCH_BUILDERS, CONTEXT_SHIFTS, EVICTIONS):
        assert all(name in text for name in registry)
    assert text.split("examples:")[1].count("slotlab simulate") == 3


def test_every_option_help_states_its_default():
    for o in OPTIONS:
        assert "default" in o.help, o.flags


def test_bad_flag_value_is_one_line_on_stderr_with_exit_code_2(capsys):
    assert main(["simulate", "--evict", "random"]) == 2
    err = capsys.readouterr().err
    assert "--evict" in err and "fifo, lru, lfu, gdsf" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) <= 2


def test_config_error_exits_2_without_traceback(capsys, tmp_path):
    assert main(["simulate", "-np", "0", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "n_parallel" in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()   # nothing is written for a run that cannot start


def test_policy_argument_to_a_policy_without_one_is_rejected(capsys):
    assert main(["simulate", "--select", "lru:5"]) == 2
    assert "takes no argument" in capsys.readouterr().err


def test_option_of_another_workload_is_an_error_not_ignored(capsys):
    assert main(["simulate", "--workload", "poisson", "--users", "3"]) == 2
    assert "--users does not apply to --workload poisson" in capsys.readouterr().err


def test_rerun_command_parses_back_to_the_same_options():
    values = values_of("-np", "2", "-cram", "-1", "--no-cache-prompt", "--workload", "poisson", "--rate", "3",
                       "--prompt-tokens", "10-20", "--evict", "lru", "--latency", "constant:0.01")
    argv = simulate_argv(values)
    assert argv[:2] == ["slotlab", "simulate"]
    assert values_of(*argv[2:]) == values


@pytest.mark.parametrize("argv", [["--help"], []])
def test_top_level_without_command_shows_help(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    assert "simulate" in out.out + out.err
    assert code == (0 if argv else 2)


def test_serve_and_generate_run_the_ggml_numerics_unless_told_otherwise():
    """The engine's default arithmetic on the command line is llama.cpp's ("ggml"); f32 and q stay selectable; an
    unknown name is a usage error."""
    parser = build_parser()
    assert parser.parse_args(["serve", "-m", "x.gguf"]).numerics == "ggml"
    assert parser.parse_args(["generate", "-m", "x.gguf", "-p", "hi"]).numerics == "ggml"
    assert parser.parse_args(["serve", "-m", "x.gguf", "--numerics", "f32"]).numerics == "f32"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "-m", "x.gguf", "--numerics", "f64"])
    from engine.model import NUMERICS_MODES
    from experiments.flags import _NUMERICS
    assert sorted(_NUMERICS) == sorted(NUMERICS_MODES)                  # the choices are the engine's modes
