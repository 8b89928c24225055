"""Roofline latency model: a forward step takes max(compute time, memory time) for a model on a machine.

Model shapes come from GGUF metadata (`ModelSpec.from_gguf`) or public configs (`MODEL_PRESETS`); machines
from measurements or vendor spec sheets (`HW_PRESETS`). Formulas and sources: docs/latency_models.md.
"""

from __future__ import annotations

import datetime
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from sim.latency import (
    DEFAULT_CALIBRATION_PATH,
    FitResult,
    MeasuredOn,
    StepCost,
    check_decode_only_args,
    fit_parametric,
    save_calibration,
    step_cost_from_chunks,
)

# Bytes per element as stored by ggml: block quants carry per-block scales (q8_0: 32 int8 + f16 scale = 34 B
# per 32 weights; q4_0: 16 B nibbles + f16 scale; q4_1: + f16 min).
DTYPE_BYTES: dict[str, float] = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q4_1": 20 / 32,
    "q4_0": 18 / 32,
}


def _dtype_bytes(dtype: str, what: str) -> float:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown {what} dtype {dtype!r}; choices: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shapes of a dense llama-family decoder and the bytes one forward pass streams.

    weight_bytes: bytes of weights read once per forward call = every tensor except the input embedding
    table (only T rows of it are gathered); with tied embeddings the table is read once as the output head.
    kv_bytes_per_token: K + V of one token over all layers.
    """

    name: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    weight_bytes: int
    kv_bytes_per_token: int

    @property
    def n_params_layer(self) -> int:
        """Matmul weights of one block: q, k, v, o projections and the SwiGLU FFN (gate, up, down)."""
        q_o = 2 * self.n_embd * self.n_head * self.head_dim
        k_v = 2 * self.n_embd * self.n_head_kv * self.head_dim
        return q_o + k_v + 3 * self.n_embd * self.n_ff

    @property
    def dense_flops_per_token(self) -> int:
        return 2 * self.n_layer * self.n_params_layer

    @property
    def logits_flops_per_row(self) -> int:
        return 2 * self.n_embd * self.n_vocab

    @property
    def attn_flops_per_ctx_token(self) -> int:
        """Q·Kᵀ and P·V: 2 FLOPs per multiply-add, head_dim each, per head and layer, per attended cell."""
        return 4 * self.n_layer * self.n_head * self.head_dim

    @classmethod
    def from_dims(
        cls,
        name: str,
        *,
        n_layer: int,
        n_embd: int,
        n_ff: int,
        n_head: int,
        n_head_kv: int,
        n_vocab: int,
        head_dim: int | None = None,
        weights_dtype: str = "f16",
        kv_dtype: str = "f16",
    ) -> ModelSpec:
        """Spec of a config whose weights are all `weights_dtype` (norm vectors included)."""
        head_dim = head_dim if head_dim is not None else n_embd // n_head
        spec = cls(name, n_layer, n_embd, n_ff, n_head, n_head_kv, head_dim, n_vocab, 0, 0)
        # blocks (+ 2 norm vectors each) + output norm + output head (tied or not, read once)
        n_streamed = n_layer * (spec.n_params_layer + 2 * n_embd) + n_embd + n_vocab * n_embd
        weight_bytes = round(n_streamed * _dtype_bytes(weights_dtype, "weights"))
        kv_bytes = round(2 * n_layer * n_head_kv * head_dim * _dtype_bytes(kv_dtype, "KV"))
        return cls(name, n_layer, n_embd, n_ff, n_head, n_head_kv, head_dim, n_vocab, weight_bytes, kv_bytes)

    @classmethod
    def from_gguf(cls, path: str | Path, *, weights_dtype: str = "stored", kv_dtype: str = "f16") -> ModelSpec:
        """Spec from GGUF metadata and tensor sizes (no dequantization).

        weights_dtype="stored" counts bytes as in the file (quantized); "f32" (etc.) counts every weight at
        that width, e.g. for an engine that dequantizes at load.
        """
        import gguf  # only needed for GGUF paths

        reader = gguf.GGUFReader(str(path))

        def get(key: str, default: object = None) -> object:
            f = reader.fields.get(key)
            return default if f is None else f.contents()

        arch = get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(f"{path}: missing GGUF key 'general.architecture'")
        if get(f"{arch}.expert_count", 0):
            raise ValueError(f"{path}: mixture-of-experts models are not supported by ModelSpec (dense only)")

        def need(key: str) -> int:
            value = get(f"{arch}.{key}")
            if not isinstance(value, int):
                raise ValueError(f"{path}: missing or non-integer GGUF key '{arch}.{key}'")
            return value

        n_embd, n_head = need("embedding_length"), need("attention.head_count")
        n_head_kv = get(f"{arch}.attention.head_count_kv", n_head)
        head_dim = get(f"{arch}.attention.key_length", n_embd // n_head)
        tensors = {t.name: t for t in reader.tensors}
        n_vocab = get(f"{arch}.vocab_size")
        if n_vocab is None:
            if "token_embd.weight" not in tensors:
                raise ValueError(f"{path}: no '{arch}.vocab_size' key and no token_embd.weight tensor")
            n_vocab = int(tensors["token_embd.weight"].shape[1])  # ggml order: [n_embd, n_vocab]
        # Untied models gather T rows of token_embd per step; tied ones stream it as the output head.
        tied = "output.weight" not in tensors
        streamed = [t for name, t in tensors.items() if tied or name != "token_embd.weight"]
        if weights_dtype == "stored":
            weight_bytes = sum(int(t.n_bytes) for t in streamed)
        else:
            per_weight = _dtype_bytes(weights_dtype, "weights")
            weight_bytes = round(sum(int(t.n_elements) for t in streamed) * per_weight)
        n_layer = need("block_count")
        kv_bytes = round(2 * n_layer * n_head_kv * head_dim * _dtype_bytes(kv_dtype, "KV"))
        name = get("general.name") or Path(path).stem
        return cls(str(name), n_layer, n_embd, need("feed_forward_length"), n_head, int(n_head_kv),
                   int(head_dim), int(n_vocab), weight_bytes, kv_bytes)


# Public HF config.json of each model (hidden_size, intermediate_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads, vocab_size); fp16 weights and f16 KV (llama.cpp's default cache).
_MODEL_DIMS: dict[str, dict[str, int | str]] = {
    "smollm2-135m": dict(name="SmolLM2-135M", n_layer=30, n_embd=576, n_ff=1536, n_head=9, n_head_kv=3,
                         head_dim=64, n_vocab=49152),  # HuggingFaceTB/SmolLM2-135M, tied embeddings
    "llama-2-7b": dict(name="Llama-2-7B", n_layer=32, n_embd=4096, n_ff=11008, n_head=32, n_head_kv=32,
                       head_dim=128, n_vocab=32000),  # meta-llama/Llama-2-7b-hf
    "llama-3-8b": dict(name="Llama-3-8B", n_layer=32, n_embd=4096, n_ff=14336, n_head=32, n_head_kv=8,
                       head_dim=128, n_vocab=128256),  # meta-llama/Meta-Llama-3-8B
    "llama-2-70b": dict(name="Llama-2-70B", n_layer=80, n_embd=8192, n_ff=28672, n_head=64, n_head_kv=8,
                        head_dim=128, n_vocab=32000),  # meta-llama/Llama-2-70b-hf (GQA, 8 KV heads)
    "qwen2.5-7b": dict(name="Qwen2.5-7B", n_layer=28, n_embd=3584, n_ff=18944, n_head=28, n_head_kv=4,
                       head_dim=128, n_vocab=152064),  # Qwen/Qwen2.5-7B (q/k/v biases ignored)
    "mistral-7b": dict(name="Mistral-7B", n_layer=32, n_embd=4096, n_ff=14336, n_head=32, n_head_kv=8,
                       head_dim=128, n_vocab=32000),  # mistralai/Mistral-7B-v0.1
}


def model_preset(key: str, *, weights_dtype: str = "f16", kv_dtype: str = "f16") -> ModelSpec:
    dims = _MODEL_DIMS.get(key.lower())
    if dims is None:
        raise ValueError(f"unknown model preset {key!r}; choices: {', '.join(_MODEL_DIMS)}")
    name, shape = dims["name"], {k: v for k, v in dims.items() if k != "name"}
    return ModelSpec.from_dims(str(name), **shape, weights_dtype=weights_dtype, kv_dtype=kv_dtype)


MODEL_PRESETS: dict[str, ModelSpec] = {key: model_preset(key) for key in _MODEL_DIMS}


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    """Peak rates of a machine and how much of them the engine reaches, plus fixed costs.

    Times: fixed_overhead_s once per execute(), per_call_overhead_s per llama_decode call,
    per_seq_overhead_s per sequence in the batch (per-chunk attention loop of a Python engine).
    host_copy_bw_bytes_s: rate of KV copies to/from the host-RAM prompt cache (bytes copied per second);
    None → a memcpy in the same memory, mem_bw·bw_efficiency/2 (each byte is read and written).
    """

    name: str
    peak_flops: float  # FLOP/s, dense, at the engine's compute dtype
    mem_bw_bytes_s: float
    flops_efficiency: float  # fraction of peak_flops the whole forward reaches
    bw_efficiency: float  # fraction of mem_bw_bytes_s weight/KV streaming reaches
    fixed_overhead_s: float
    per_call_overhead_s: float
    per_seq_overhead_s: float = 0.0
    host_copy_bw_bytes_s: float | None = None

    def __post_init__(self) -> None:
        if not (self.peak_flops > 0 and self.mem_bw_bytes_s > 0):
            raise ValueError(f"HardwareSpec {self.name}: peak_flops and mem_bw_bytes_s must be > 0")
        if not (0 < self.flops_efficiency <= 1 and 0 < self.bw_efficiency <= 1):
            raise ValueError(f"HardwareSpec {self.name}: efficiencies must be in (0, 1]")
        if min(self.fixed_overhead_s, self.per_call_overhead_s, self.per_seq_overhead_s) < 0:
            raise ValueError(f"HardwareSpec {self.name}: overheads must be >= 0")
        if self.host_copy_bw_bytes_s is not None and not self.host_copy_bw_bytes_s > 0:
            raise ValueError(f"HardwareSpec {self.name}: host_copy_bw_bytes_s must be > 0 or None")


# GPU figures: NVIDIA datasheets, dense FP16 tensor-core FLOP/s (datasheets print 2× "with sparsity") and
# memory bandwidth. Host copies run over PCIe: ~25 GB/s effective for Gen4 x16, ~50 GB/s for Gen5 x16.
# GPU efficiencies/overheads are typical serving-stack values (assumptions, not measurements).
_GPU_EFF = dict(flops_efficiency=0.5, bw_efficiency=0.7, fixed_overhead_s=1e-3, per_call_overhead_s=0.5e-3)
HW_PRESETS: dict[str, HardwareSpec] = {
    # This dev container: 2 vCPU Xeon (AVX-512, KVM). Measured: ~245 GFLOP/s f32 sgemm on 2 threads,
    # ~23 GB/s memory read, ~10 GB/s np.copyto. Efficiencies/overheads are estimates for the numpy engine
    # (f32 BLAS matmuls + numpy elementwise ops, Python loop over layers and over chunks for attention).
    "cpu-2core": HardwareSpec("cpu-2core", peak_flops=245e9, mem_bw_bytes_s=23e9, flops_efficiency=0.6,
                              bw_efficiency=0.8, fixed_overhead_s=1e-3, per_call_overhead_s=2e-3,
                              per_seq_overhead_s=0.6e-3, host_copy_bw_bytes_s=10e9),
    # A100 SXM4 40GB: 312 TFLOP/s FP16 tensor (624 sparse), 1,555 GB/s HBM2, PCIe Gen4.
    "a100-40gb": HardwareSpec("a100-40gb", peak_flops=312e12, mem_bw_bytes_s=1555e9,
                              host_copy_bw_bytes_s=25e9, **_GPU_EFF),
    # A100 SXM4 80GB: 312 TFLOP/s FP16 tensor, 2,039 GB/s HBM2e, PCIe Gen4.
    "a100-80gb": HardwareSpec("a100-80gb", peak_flops=312e12, mem_bw_bytes_s=2039e9,
                              host_copy_bw_bytes_s=25e9, **_GPU_EFF),
    # H100 SXM5 80GB: 989.4 TFLOP/s FP16 tensor (1,979 sparse), 3.35 TB/s HBM3, PCIe Gen5.
    "h100-sxm": HardwareSpec("h100-sxm", peak_flops=989.4e12, mem_bw_bytes_s=3350e9,
                             host_copy_bw_bytes_s=50e9, **_GPU_EFF),
    # H100 PCIe 80GB: 756 TFLOP/s FP16 tensor (1,513 sparse), 2.0 TB/s HBM2e, PCIe Gen5.
    "h100-pcie": HardwareSpec("h100-pcie", peak_flops=756e12, mem_bw_bytes_s=2000e9,
                              host_copy_bw_bytes_s=50e9, **_GPU_EFF),
    # L4: 121 TFLOP/s FP16 tensor (242 sparse), 300 GB/s GDDR6, PCIe Gen4.
    "l4": HardwareSpec("l4", peak_flops=121e12, mem_bw_bytes_s=300e9, host_copy_bw_bytes_s=25e9, **_GPU_EFF),
    # A10G (AWS g5): 600 GB/s GDDR6 like the A10; no NVIDIA datasheet — ~70 TFLOP/s FP16 tensor as reported
    # by third parties (the A10 datasheet gives 125). Least certain figure here.
    "a10g": HardwareSpec("a10g", peak_flops=70e12, mem_bw_bytes_s=600e9, host_copy_bw_bytes_s=25e9, **_GPU_EFF),
    # RTX 4090 (Ada whitepaper): 165.2 TFLOP/s FP16 tensor with FP32 accumulate (330.3 with FP16
    # accumulate), 1,008 GB/s GDDR6X, PCIe Gen4.
    "rtx-4090": HardwareSpec("rtx-4090", peak_flops=165.2e12, mem_bw_bytes_s=1008e9,
                             host_copy_bw_bytes_s=25e9, **_GPU_EFF),
}


@dataclass(frozen=True, slots=True)
class RooflineBreakdown:
    """The terms of one step's roofline time, in seconds."""

    overhead_s: float  # fixed + per call + per sequence
    compute_s: float  # FLOPs / (peak · efficiency)
    memory_s: float  # bytes / (bandwidth · efficiency)
    copy_s: float  # host prompt-cache copies, serialized before the forward
    shift_s: float  # K re-rotation pass, serialized before the forward

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"

    @property
    def total_s(self) -> float:
        return self.overhead_s + max(self.compute_s, self.memory_s) + self.copy_s + self.shift_s


@dataclass(frozen=True, slots=True)
class RooflineLatency:
    """t = overheads + max(FLOPs / F, bytes / B) + copy_bytes / C + shift_bytes / B (docs/latency_models.md).

    FLOPs = dense_flops_per_token·n_tokens + logits_flops_per_row·n_seqs + attn_flops_per_ctx_token·attn_ctx
    bytes = weight_bytes·n_forward_calls + kv_bytes_per_token·(kv_read_tokens + n_tokens)
    """

    model: ModelSpec
    hw: HardwareSpec
    # Per-unit constants of the hot path (step_time_s runs once per simulated step).
    _dense_flops: int = field(init=False, repr=False, compare=False)
    _logits_flops: int = field(init=False, repr=False, compare=False)
    _attn_flops: int = field(init=False, repr=False, compare=False)
    _flops_rate: float = field(init=False, repr=False, compare=False)
    _bw_rate: float = field(init=False, repr=False, compare=False)
    _copy_rate: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        m, hw = self.model, self.hw
        bw_rate = hw.mem_bw_bytes_s * hw.bw_efficiency
        object.__setattr__(self, "_dense_flops", m.dense_flops_per_token)
        object.__setattr__(self, "_logits_flops", m.logits_flops_per_row)
        object.__setattr__(self, "_attn_flops", m.attn_flops_per_ctx_token)
        object.__setattr__(self, "_flops_rate", hw.peak_flops * hw.flops_efficiency)
        object.__setattr__(self, "_bw_rate", bw_rate)
        object.__setattr__(self, "_copy_rate", hw.host_copy_bw_bytes_s or bw_rate / 2)

    def flops(self, cost: StepCost) -> int:
        n_tokens = cost.n_prefill_tokens + cost.n_decode_tokens
        return self._dense_flops * n_tokens + self._logits_flops * cost.n_seqs + self._attn_flops * cost.attn_ctx_tokens

    def bytes_moved(self, cost: StepCost) -> float:
        """Weights once per forward call, KV read once per sequence and layer, new KV written once."""
        n_tokens = cost.n_prefill_tokens + cost.n_decode_tokens
        return (self.model.weight_bytes * cost.n_forward_calls
                + self.model.kv_bytes_per_token * (cost.kv_read_tokens_or_estimate() + n_tokens))

    def breakdown(self, cost: StepCost) -> RooflineBreakdown:
        hw = self.hw
        return RooflineBreakdown(
            overhead_s=(hw.fixed_overhead_s + hw.per_call_overhead_s * cost.n_forward_calls
                        + hw.per_seq_overhead_s * cost.n_seqs),
            compute_s=self.flops(cost) / self._flops_rate,
            memory_s=self.bytes_moved(cost) / self._bw_rate,
            copy_s=cost.kv_copy_bytes / self._copy_rate,
            # re-rotation reads and writes K (half of kv_bytes_per_token) of every shifted cell
            shift_s=cost.kv_shift_tokens * self.model.kv_bytes_per_token / self._bw_rate,
        )

    def step_time_s(self, cost: StepCost) -> float:
        return self.breakdown(cost).total_s

    def decode_only_times_s(self, n_seqs: int, attn_ctx0: int, k: int) -> list[float]:
        check_decode_only_args(n_seqs, attn_ctx0, k)
        m, hw = self.model, self.hw
        # Decode-only: kv_read_tokens == attn_ctx_tokens exactly; every term is computed in the order
        # breakdown() computes it, so the results are bit-equal to step_time_s.
        overhead_s = hw.fixed_overhead_s + hw.per_call_overhead_s * 1 + hw.per_seq_overhead_s * n_seqs
        attn_ctx = attn_ctx0 + n_seqs * np.arange(k, dtype=np.int64)  # [k]
        flops = self._dense_flops * n_seqs + self._logits_flops * n_seqs + self._attn_flops * attn_ctx  # [k]
        bytes_moved = m.weight_bytes * 1 + m.kv_bytes_per_token * (attn_ctx.astype(np.float64) + n_seqs)  # [k]
        step_s = overhead_s + np.maximum(flops / self._flops_rate, bytes_moved / self._bw_rate) + 0.0 + 0.0
        return step_s.tolist()

    def describe(self) -> dict:
        return {"kind": "roofline", "model": asdict(self.model), "hw": asdict(self.hw)}


def roofline_from_spec(arg: str) -> RooflineLatency:
    """Parse "MODEL_PRESET_OR_GGUF[:WEIGHTS_DTYPE[:KV_DTYPE]]@HW_PRESET" (the part after "roofline:")."""
    model_part, at, hw_key = arg.rpartition("@")
    if not at or not model_part:
        raise ValueError(f"latency model 'roofline:{arg}': expected roofline:MODEL[:WEIGHTS_DTYPE[:KV_DTYPE]]@HW "
                         f"(models: {', '.join(MODEL_PRESETS)} or a .gguf path; hardware: {', '.join(HW_PRESETS)})")
    hw = HW_PRESETS.get(hw_key.lower())
    if hw is None:
        raise ValueError(f"unknown hardware preset {hw_key!r}; choices: {', '.join(HW_PRESETS)}")
    dtypes: list[str] = []
    while len(dtypes) < 2 and model_part.rpartition(":")[2].lower() in DTYPE_BYTES and ":" in model_part:
        model_part, _, dtype = model_part.rpartition(":")
        dtypes.insert(0, dtype.lower())
    weights_dtype, kv_dtype = (dtypes + [None, None])[:2]
    if model_part.lower() in MODEL_PRESETS:
        model = model_preset(model_part, weights_dtype=weights_dtype or "f16", kv_dtype=kv_dtype or "f16")
    elif model_part.endswith(".gguf") or Path(model_part).is_file():
        model = ModelSpec.from_gguf(model_part, weights_dtype=weights_dtype or "stored", kv_dtype=kv_dtype or "f16")
    else:
        raise ValueError(f"unknown model {model_part!r}; choices: {', '.join(MODEL_PRESETS)} or a .gguf path")
    return RooflineLatency(model, hw)


# --- the shipped default calibration --------------------------------------------------------------


def calibration_grid() -> list[StepCost]:
    """Steps spanning what the numpy engine serves: decode batches, prompt chunks, mixes, copies, shifts."""
    grid = [step_cost_from_chunks(decode_n_past=[ctx] * n)
            for n in (1, 2, 4, 8, 16, 32) for ctx in (32, 256, 1024, 4096)]
    grid += [step_cost_from_chunks([(pos0, n)]) for n in (8, 32, 128, 512, 2048) for pos0 in (0, 1024, 4096)]
    grid += [step_cost_from_chunks([(0, n)], [512] * n_dec) for n in (32, 256, 1024) for n_dec in (1, 4, 16)]
    grid += [step_cost_from_chunks(decode_n_past=[256], kv_copy_bytes=b) for b in (10**6, 10**7, 10**8)]
    grid += [step_cost_from_chunks(decode_n_past=[256], kv_shift_tokens=s) for s in (256, 2048)]
    # n_batch halving splits a batch into several llama_decode calls, each re-reading the weights
    grid += [step_cost_from_chunks([(0, 512)], n_forward_calls=2)]
    grid += [step_cost_from_chunks(decode_n_past=[256] * 8, n_forward_calls=c) for c in (2, 4)]
    return grid


def fit_to_roofline(roofline: RooflineLatency, grid: list[StepCost] | None = None) -> FitResult:
    """Fit a ParametricLatency to a roofline's predictions (a stand-in until a measured calibration exists)."""
    grid = calibration_grid() if grid is None else grid
    return fit_parametric([(cost, roofline.step_time_s(cost)) for cost in grid])


def write_default_calibration(path: str | Path = DEFAULT_CALIBRATION_PATH, date: str | None = None) -> FitResult:
    """Regenerate sim/data/default_calibration.json from the SmolLM2-135M (f32) roofline on cpu-2core."""
    model = model_preset("smollm2-135m", weights_dtype="f32", kv_dtype="f32")
    roofline = RooflineLatency(model, HW_PRESETS["cpu-2core"])
    fit = fit_to_roofline(roofline)
    measured_on = MeasuredOn(
        machine="slotlab dev container (2 vCPU KVM guest), hardware preset cpu-2core",
        cpu="Intel Xeon (family 6 model 207, AVX-512), 2 cores; ~245 GFLOP/s f32 sgemm, ~23 GB/s read",
        threads=2,
        engine="none: derived from sim.roofline.RooflineLatency, not measured on the numpy engine",
        model="SmolLM2-135M, f32 weights (dequantized at load), f32 KV",
        date=date or datetime.date.today().isoformat(),
        notes=(f"ParametricLatency fitted ({fit.method}, {fit.weighting} weighting) to roofline predictions "
               f"over {fit.n_rows} grid steps (sim.roofline.calibration_grid): R2={fit.r2:.4f}, "
               f"MAPE={fit.mape:.1%}, max APE={fit.max_ape:.1%}. Placeholder until the numpy engine's "
               f"measured calibration replaces this file (same format). Regenerate: python -m sim.roofline"),
    )
    save_calibration(fit.model, path, measured_on, fit)
    return fit


if __name__ == "__main__":
    result = write_default_calibration()
    print(f"wrote {DEFAULT_CALIBRATION_PATH}: {result.stats()}")
