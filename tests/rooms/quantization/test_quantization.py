"""Weight-only int8/int4: each quantized linear computes the matmul with its dequantized weight, a
quantized model computes what the float model with those weights computes, the engine batches,
preempts and frees blocks with it, and bad settings are refused before anything is loaded. Quantized
checkpoints: test_quantized_checkpoints.py."""

import pytest
import torch
from torch import nn

from minfer import LLM, SamplingParams
from minfer.engine.config import EngineConfig
from minfer.models.registry import load_model
from minfer.quantization import (
    Int4Linear,
    Int8Linear,
    QuantizedEmbedding,
    QuantizedLinear,
    check_quantization,
    int4_kernel_available,
    quantization_of,
    quantize_int4,
    quantize_int8,
    quantize_model,
)
from minfer.quantization import int4 as int4_module
from minfer.quantization.checkpoint import QuantizationSpec, QuantizedWeights
from minfer.quantization.int4 import dequantize_int4
from minfer.quantization.int8 import dequantize_int8

needs_int4 = pytest.mark.skipif(not int4_kernel_available(), reason="torch's CPU int4 kernels need torch >= 2.6")
# Rows on both sides of each format's bucket boundaries: the kernel below them, int8's rounded rows
# between (where the CPU has int8 dot products), dequantize + GEMM above.
ROWS = [1, 3, 5, 9, 16, 17, 33, 64, 65, 129]
# Odd shapes: inner widths that are no multiple of 16 or of the group size, a 3-head-like 72, a vocabulary
# that is no multiple of 64.
SHAPES = [(70, 100), (72, 803), (128, 64), (24, 40)]


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


def tolerance(layer, rows: int, dtype: torch.dtype) -> float:
    """fp32 through dequantize + GEMM: the same sums in another order. Through the kernel, fp32 rows go as
    bf16 (quantization/linear.py), so they round as bf16 rows do: activations and output to 8 bits."""
    return 1e-5 if dtype == torch.float32 and not layer.uses_kernel(rows) else 2e-2


def assert_fp32_rows_take_the_bf16_kernel(layer, x: torch.Tensor) -> None:
    """The kernel gives fp32 rows exactly what it gives the same rows in bf16 (the bias comes after)."""
    if x.dtype == torch.float32:
        rows = x.reshape(-1, x.shape[-1])
        assert torch.equal(layer.kernel(rows), layer.kernel(rows.bfloat16()).float())


@pytest.mark.parametrize("in_features,out_features", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_is_the_matmul_with_its_dequantized_weight(in_features, out_features, rows, dtype):
    torch.manual_seed(rows)
    linear = nn.Linear(in_features, out_features)
    q, scales = quantize_int8(linear.weight)
    reference_weight = dequantize_int8(q, scales)  # (out, in) fp32
    x = torch.randn(2, rows, in_features).to(dtype)
    layer = Int8Linear.from_float(linear)
    y = layer(x)
    assert y.shape == (2, rows, out_features) and y.dtype == dtype
    ref = x.float() @ reference_weight.t() + linear.bias
    assert relative_error(y, ref) < tolerance(layer, 2 * rows, dtype)
    assert_fp32_rows_take_the_bf16_kernel(layer, x)


@needs_int4
@pytest.mark.parametrize("in_features,out_features", SHAPES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_is_the_matmul_with_its_dequantized_weight(in_features, out_features, group_size, rows, dtype):
    torch.manual_seed(rows)
    linear = nn.Linear(in_features, out_features)
    nibbles, scales_and_zeros = quantize_int4(linear.weight, group_size)
    reference_weight = dequantize_int4(nibbles, scales_and_zeros)[:, :in_features]
    x = torch.randn(rows, in_features).to(dtype)
    layer = Int4Linear.from_float(linear, group_size)
    ref = x.float() @ reference_weight.t() + linear.bias
    y = layer(x)
    assert relative_error(y, ref) < tolerance(layer, rows, dtype)
    assert_fp32_rows_take_the_bf16_kernel(layer, x)
    stored = layer.stored()  # the packed layout gives back exactly what was quantized
    assert torch.equal(stored[0], nibbles) and torch.equal(stored[1], scales_and_zeros)


def test_an_int8_weight_off_a_64_byte_boundary_runs():
    """safetensors hands a checkpoint's tensors out at any 8-byte offset; _weight_int8pack_mm crashed
    (a segfault) on a weight not on a 64-byte boundary, so Int8Linear copies such a weight."""
    buffer = torch.zeros(192 * 64 + 40, dtype=torch.int8)
    q = buffer[40:].view(192, 64)  # 40 bytes past an aligned start
    q.copy_(torch.randint(-127, 128, (192, 64)))
    layer = Int8Linear(q, torch.rand(192))
    assert layer.qweight.data_ptr() % 64 == 0 and torch.equal(layer.qweight, q)
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x.bfloat16()).float(), layer(x.bfloat16().float()), atol=0, rtol=0)


def test_int8_scales_are_numbers_the_bf16_kernel_reads_unchanged():
    """The kernel takes scales in bf16: scales bf16 holds exactly make its products q * scale the
    dequantized weight itself, not a whole row scaled up to 0.4% off."""
    torch.manual_seed(0)
    w = torch.randn(500, 64) * torch.logspace(-4, 1, 500)[:, None]  # rows of very different sizes
    q, scales = quantize_int8(w)
    assert torch.equal(scales.bfloat16().float(), scales)
    largest = w.abs().amax(dim=1) / 127
    assert ((scales - largest).abs() <= largest * 2**-8).all()  # the nearest bf16: half a step of 8 bits
    assert (q.abs().amax(dim=1) == 127).all()  # a row's largest weight still uses the full range
    assert torch.equal(quantize_int8(q * scales[:, None])[1], scales)  # quantizing it again: the same
    layer = Int8Linear(q, scales)
    x = torch.randn(1, 64).bfloat16()
    exact = (x.double() @ (q.double() * scales.double()[:, None]).t()).float()  # (1, 500)
    assert torch.equal(layer(x), exact.bfloat16())  # only the output's own rounding


@pytest.mark.parametrize("method", ["int8", pytest.param("int4", marks=needs_int4)])
def test_quantizing_in_row_chunks_changes_nothing(monkeypatch, method):
    """Large matrices are quantized and packed a few rows at a time (bounded memory): same result."""
    from minfer.quantization import int8 as int8_module

    torch.manual_seed(0)
    linear = nn.Linear(100, 300)
    whole = Int8Linear.from_float(linear) if method == "int8" else Int4Linear.from_float(linear, 32)
    monkeypatch.setattr(int8_module, "CHUNK_ELEMENTS", 64 * 128)
    monkeypatch.setattr(int4_module, "CHUNK_ELEMENTS", 64 * 128)
    chunked = Int8Linear.from_float(linear) if method == "int8" else Int4Linear.from_float(linear, 32)
    for a, b in zip(whole.stored(), chunked.stored()):
        assert torch.equal(a, b)
    assert torch.equal(whole.qweight, chunked.qweight)


@pytest.mark.parametrize("method", ["int8", pytest.param("int4", marks=needs_int4)])
def test_quantization_error_is_bounded_by_half_a_step(method):
    torch.manual_seed(0)
    w = torch.randn(96, 200)
    if method == "int8":
        q, scales = quantize_int8(w)
        error, step = (dequantize_int8(q, scales) - w).abs(), scales[:, None]  # (96, 200), (96, 1)
    else:
        nibbles, sz = quantize_int4(w, 64)  # 200 columns: the last group is padded with zeros
        error = (dequantize_int4(nibbles, sz)[:, :200] - w).abs()
        step = sz[:, :, 0].t().repeat_interleave(64, dim=1)[:, :200]  # each weight's group scale
    assert (error <= step / 2 + 1e-6).all()
    assert error.max() > 0  # it did quantize


@pytest.mark.parametrize("method", ["int8", pytest.param("int4", marks=needs_int4)])
def test_tied_embedding_reads_the_heads_quantized_rows(method):
    torch.manual_seed(0)
    head = nn.Linear(72, 803, bias=False)
    quantized = Int8Linear.from_float(head) if method == "int8" else Int4Linear.from_float(head, 32)
    embedding = QuantizedEmbedding(quantized, torch.float32)
    ids = torch.tensor([[0, 802, 64, 63], [31, 32, 400, 5]])
    full = quantized.dequantized(torch.float32)  # (803, 72)
    assert torch.equal(embedding(ids), full[ids])
    assert embedding.weight.dtype == torch.float32 and embedding.weight.numel() == 0


@pytest.mark.parametrize("method", ["int8", pytest.param("int4", marks=needs_int4)])
def test_a_tied_embeddings_lookup_exports_for_any_number_of_tokens(method):
    """--compile-model's batch package is exported with the step's token count dynamic (compiled/packaged.py):
    the lookup must not fix it to the example's (int4's once did, and its batches ran eager)."""
    torch.manual_seed(0)
    head = nn.Linear(72, 803, bias=False)
    quantized = Int8Linear.from_float(head) if method == "int8" else Int4Linear.from_float(head, 32)
    embedding = QuantizedEmbedding(quantized, torch.float32)
    program = torch.export.export(embedding, (torch.tensor([0, 802, 64]),),
                                  dynamic_shapes=({0: torch.export.Dim("tokens", min=2)},))
    ids = torch.tensor([31, 32, 400, 5, 63])
    assert torch.equal(program.module()(ids), embedding(ids))


def float_model_with_dequantized_weights(checkpoint, method, group_size=None):
    """The float model whose weights are what quantizing them gives back: what a quantized model must compute."""
    model = load_model(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        for module in model.modules():
            if type(module) is nn.Linear or module is getattr(model, "embed_tokens", None):  # Llama's untied table
                if method == "int8":
                    module.weight.copy_(dequantize_int8(*quantize_int8(module.weight)))
                else:
                    w = dequantize_int4(*quantize_int4(module.weight, group_size or 64))
                    module.weight.copy_(w[:, : module.weight.shape[1]])
    return model


@pytest.mark.parametrize("preset", ["tiny", "qwen3-tiny", "llama-tiny", "odd"])
@pytest.mark.parametrize("method", ["int8", pytest.param("int4", marks=needs_int4)])
def test_quantized_model_computes_the_dequantized_float_model(make_checkpoint, preset, method):
    """Every linear, the LM head and the token embedding (tied or not) quantized; nothing else changed."""
    if preset == "odd":  # 3 heads of 24 channels, a vocabulary that is no multiple of 64
        checkpoint = make_checkpoint("tiny", n_embd=72, n_head=3, vocab_size=503)
    else:
        checkpoint = make_checkpoint(preset)
    reference = float_model_with_dequantized_weights(checkpoint, method)
    model = quantize_model(load_model(checkpoint, dtype=torch.float32), method)
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(getattr(model, "wte", None) or model.embed_tokens, QuantizedEmbedding)
    assert isinstance(model.lm_head, QuantizedLinear) and model.dtype == torch.float32
    # 3 rows: the kernel; 20: int8 splits them into two int8 halves (on a CPU with int8 dot products, else
    # as 3); 150: dequantize + GEMM, for both formats
    for batch, length in ((1, 3), (2, 10), (3, 50)):
        ids = torch.randint(0, model.config.vocab_size, (batch, length))
        with torch.inference_mode():
            got, want = model(ids), reference(ids)
        rows = batch * length
        if not model.lm_head.uses_kernel(rows):
            torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
        elif method == "int8" and model.lm_head.rounds_rows(rows):  # rows held to ~1.6e-5 of their largest
            assert relative_error(got, want) < 1e-3  # (up to 1.3e-4 measured)
        else:  # the kernels take fp32 rows as bf16 (quantization/linear.py): bf16's rounding, layer after
            assert relative_error(got, want) < 3e-2  # layer (0.7-2.3% of the largest logit, measured)


def test_keeping_the_head_full_precision_keeps_the_tied_embedding_too(tiny_checkpoint, tmp_path):
    """After loading, while loading (`--quantization int8 --no-quantize-lm-head`, which once refused a
    tied checkpoint: "holds unexpected tensor 'lm_head.weight'") and from a `minfer quantize` checkpoint."""
    from minfer.quantization.checkpoint import save_quantized

    after = quantize_model(load_model(tiny_checkpoint), "int8", quantize_lm_head=False)
    spec = QuantizationSpec("int8", quantize_lm_head=False)
    streamed = load_model(tiny_checkpoint, weights=QuantizedWeights(spec))
    loaded = load_model(save_quantized(streamed, tiny_checkpoint, tmp_path / "q", spec), weights=QuantizedWeights())
    ids = torch.randint(0, 500, (1, 7))
    with torch.inference_mode():
        want = after(ids)
    for model in (after, streamed, loaded):
        assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.wte.weight
        assert isinstance(model.h[0].mlp.c_fc, Int8Linear)
        with torch.inference_mode():
            torch.testing.assert_close(model(ids), want, atol=0, rtol=0)


GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.mark.parametrize("method", ["int8", pytest.param("int4", marks=needs_int4)])
def test_engine_batches_and_preempts_a_quantized_model(tiny_checkpoint, method, monkeypatch):
    """A prompt run with 23 others (chunked prefill, preemption, prefix reuse) gives the tokens it gives
    alone, and every block is free after. Every row count through the kernels: in fp32 they round the
    rows to bf16 and the dequantize + GEMM path of batches does not, which alone can flip a near-tie."""
    for layer in (Int8Linear, Int4Linear):
        monkeypatch.setattr(layer, "kernel_max_rows", 1 << 30)
    monkeypatch.setattr(Int8Linear, "rounds_batches", False)  # weight-only: no rows rounded to int8
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 511, (int(n),), generator=generator).tolist()
               for n in torch.randint(5, 150, (24,), generator=generator)]
    prompts[1] = prompts[0][:60] + prompts[1]  # a shared prefix
    busy = LLM(tiny_checkpoint, quantization=method, num_kv_blocks=30, max_num_seqs=24, max_num_batched_tokens=48)
    together = busy.generate(prompts, GREEDY, use_tqdm=False)
    stats = busy.stats()
    assert stats["num_preemptions"] > 0 and stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
    busy.scheduler.check_invariants()
    alone = LLM(tiny_checkpoint, quantization=method, num_kv_blocks=64, enable_prefix_caching=False)
    matches = sum(out.token_ids == alone.generate([p], GREEDY, use_tqdm=False)[0].token_ids
                  for p, out in zip(prompts, together))
    assert matches == len(prompts)


def test_unknown_quantization_is_refused_naming_what_is_supported():
    with pytest.raises(ValueError, match=r"--quantization must be one of int8, int4, got 'int5'"):
        EngineConfig(quantization="int5")
    with pytest.raises(ValueError, match=r"got 'gptq' \(gptq checkpoints are not supported.*--quantization int8 or int4"):
        EngineConfig(quantization="gptq")
    with pytest.raises(ValueError, match=r"got 'awq' \(awq checkpoints"):
        check_quantization("awq")
    with pytest.raises(ValueError, match="--quantization-group-size"):
        EngineConfig(quantization="int8", quantization_group_size=64)
    with pytest.raises(ValueError, match="--quantization-group-size"):
        EngineConfig(quantization="int4", quantization_group_size=48)


def test_int4_without_its_kernels_is_refused_before_loading(monkeypatch, tiny_checkpoint):
    monkeypatch.setattr(int4_module, "int4_kernel_available", lambda: False)
    monkeypatch.setattr("minfer.quantization.transform.int4_kernel_available", lambda: False)
    with pytest.raises(ValueError, match=r"int4 needs torch's CPU int4 kernels \(torch >= 2.6\).*int8"):
        LLM(tiny_checkpoint, quantization="int4")
    assert EngineConfig(quantization="int8").quantization == "int8"


def test_a_model_prepared_without_quantization_is_not_quantized_behind_its_back(tiny_checkpoint):
    llm = LLM(tiny_checkpoint)
    with pytest.raises(ValueError, match="load it again"):
        quantize_model(llm.model, "int8")
    model = quantize_model(load_model(tiny_checkpoint), "int8")
    assert quantize_model(model, "int8") is model  # again: nothing changes
    with pytest.raises(ValueError, match="already quantized to int8"):
        quantize_model(model, "int4")


def test_roofline_and_profile_count_quantized_bytes(make_checkpoint):
    """--roofline's floor reads the quantized bytes; --profile's linears are the quantized ones, not the
    untied embedding's table (read a row at a time)."""
    from minfer.bench.roofline import module_bytes, weight_bytes, weight_linears, weights_name

    model = quantize_model(load_model(make_checkpoint("llama-tiny")), "int8")
    float_bytes = sum(p.numel() * 4 for p in load_model(make_checkpoint("llama-tiny")).parameters())
    assert weights_name(model) == "int8 + float32"
    assert weight_bytes(model) < float_bytes / 3  # int8 weights: a quarter of fp32, plus scales and norms
    linears = weight_linears(model)
    assert len(linears) == 7 * model.config.num_layers and all(isinstance(m, Int8Linear) for m in linears)
    assert module_bytes(linears[0]) == linears[0].qweight.numel() + 4 * linears[0].out_features


def test_a_quantizing_load_holds_mallocs_mmap_threshold_low_and_releases_it(monkeypatch, tiny_checkpoint):
    """models/malloc.py: while a quantized model loads, freed float tensors go back to the OS (peak RSS);
    after, both thresholds sit where glibc's own rule would put them, so steps reuse the heap (a trim
    threshold left at 128 KiB gave memory back, and faulted it in again, every step); a plain load
    leaves malloc alone."""
    from minfer.cpu import malloc

    calls = []
    monkeypatch.setattr(malloc, "glibc_mallopt", lambda: lambda param, value: calls.append((param, value)))
    load_model(tiny_checkpoint)
    assert calls == []
    model = load_model(tiny_checkpoint, weights=QuantizedWeights(QuantizationSpec("int8", None, True)))
    assert calls == [(malloc.M_MMAP_THRESHOLD, 128 << 10), (malloc.M_MMAP_THRESHOLD, 32 << 20),
                     (malloc.M_TRIM_THRESHOLD, 64 << 20)]
    assert quantization_of(model) == "int8"


@pytest.mark.parametrize("method", ["int8", pytest.param("int4", marks=needs_int4)])
def test_the_gemm_path_in_tiles_is_the_matmul_with_the_dequantized_weight(monkeypatch, method):
    """A large weight (an LM head) is widened a tile of output channels at a time through one reused buffer
    (linear.tiled_matmul): here tiles of 64 channels, the last one short, in fp32."""
    from minfer.quantization import int4 as int4_module
    from minfer.quantization import int8 as int8_module

    for module in (int8_module, int4_module):
        monkeypatch.setattr(module, "GEMM_TILE_ELEMENTS", 64 * 96)  # 64 channels of 96 inputs (int4: whole blocks)
    torch.manual_seed(0)
    linear = nn.Linear(96, 300)  # 300: no multiple of a tile
    layer = Int8Linear.from_float(linear) if method == "int8" else Int4Linear.from_float(linear, 32)
    x = torch.randn(70, 96)
    want = x @ layer.dequantized(torch.float32).t() + linear.bias
    assert relative_error(layer.gemm(x), want) < 1e-5


@pytest.mark.parametrize("method", ["int8", pytest.param("int4", marks=needs_int4)])
def test_a_widened_weight_runs_in_and_out_of_inference_mode(method):
    """The reused widening buffer is made by whichever call comes first: made in inference mode (an engine
    step) it must not become an inference tensor that a later call outside it (a test, a script) may not
    write."""
    torch.manual_seed(0)
    linear = nn.Linear(96, 128)
    layer = Int8Linear.from_float(linear) if method == "int8" else Int4Linear.from_float(linear, 32)
    x = torch.randn(70, 96)  # enough rows for the widening path
    want = x @ layer.dequantized(torch.float32).t() + linear.bias
    with torch.inference_mode():
        inside = layer.gemm(x)
    with torch.no_grad():
        outside = layer.gemm(x)
    assert relative_error(inside, want) < 1e-5 and relative_error(outside, want) < 1e-5
