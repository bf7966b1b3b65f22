"""--quantize-activations: int8 weights times activations rounded to int8 per row (torch._int_mm).
Each linear computes exactly the matmul of its per-row-rounded input with its dequantized weight, at
every row count; that stays close to the weight-only result; a row's output does not depend on the
rows beside it (so batching changes no token); and it is refused where it does not apply."""

import pytest
import torch
from torch import nn

from minfer import LLM, SamplingParams
from minfer.engine.config import EngineConfig
from minfer.models.registry import load_model
from minfer.quantization import Int8Linear, quantize_int8, quantize_model
from minfer.quantization.int8 import dequantize_int8, dynamic_int8_mm, split_int8_mm

ROWS = [1, 3, 16, 17, 65]  # both sides of the weight-only path's bucket boundary (16)
SHAPES = [(70, 100), (72, 803), (128, 64), (24, 40)]  # inner widths no multiple of 16, a vocabulary of 803


def rounded_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row of x (M, K) rounded to 255 levels of its own largest magnitude, in fp32."""
    x = x.float()
    scale = x.abs().amax(dim=1, keepdim=True) / 127
    return torch.round(x / scale) * scale


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("in_features,out_features", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_with_int8_activations_is_the_matmul_of_rounded_rows(in_features, out_features, rows, dtype):
    torch.manual_seed(rows)
    linear = nn.Linear(in_features, out_features)
    layer = Int8Linear.from_float(linear)
    layer.quantize_activations = True
    x = torch.randn(rows, in_features).to(dtype)
    weight = dequantize_int8(*quantize_int8(linear.weight))  # (out, in) fp32
    y = layer(x)
    assert y.shape == (rows, out_features) and y.dtype == dtype
    # The int32 sums are exact, so fp32 agrees to rounding; and above 16 rows too (no dequantize + GEMM path).
    exact = rounded_rows(x) @ weight.t() + linear.bias
    assert relative_error(y, exact) < (1e-5 if dtype == torch.float32 else 2e-2)
    # Against unrounded activations: the second rounding costs about 1/254 of a row's largest value.
    assert relative_error(y, x.float() @ weight.t() + linear.bias) < 2e-2


@pytest.mark.parametrize("rows", [4, 64])
def test_without_int8_dot_products_the_sums_are_the_same_in_fp32(monkeypatch, rows):
    """A CPU without VNNI or AMX multiplies the rounded rows in fp32 (torch._int_mm has no fast kernel there):
    the products are exact and so are the sums below 2**24 (K = 768 here: any rows), so not one bit differs."""
    from minfer.quantization import int8

    torch.manual_seed(rows)
    q, scales = quantize_int8(torch.randn(300, 768))
    x = torch.randn(rows, 768)
    x[0, :] = torch.sign(x[0, :])  # the largest sums there can be: every product at +-127 x the row's weights
    monkeypatch.setattr(int8, "HAS_INT8_DOT", True)
    by_int8 = dynamic_int8_mm(x, q, scales)
    monkeypatch.setattr(int8, "HAS_INT8_DOT", False)
    by_fp32 = dynamic_int8_mm(x, q, scales)
    assert torch.equal(by_fp32, by_int8)


def test_a_row_of_zeros_gives_the_bias_and_rows_do_not_see_each_other():
    torch.manual_seed(0)
    q, scales = quantize_int8(torch.randn(48, 32))
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    x[2] = 0
    y = dynamic_int8_mm(x, q, scales)
    assert torch.equal(y[2], torch.zeros(48, dtype=torch.bfloat16))
    for i in range(5):  # each row's own scale: the same row alone gives the same bits
        assert torch.equal(dynamic_int8_mm(x[i : i + 1], q, scales)[0], y[i])


def test_quantized_activations_cover_every_int8_linear_and_the_head(tiny_checkpoint):
    model = quantize_model(load_model(tiny_checkpoint), "int8", quantize_activations=True)
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert model.lm_head in layers and all(m.quantize_activations for m in layers)
    quantize_model(model, "int8")  # asked again without it: weight-only again, weights untouched
    assert not any(m.quantize_activations for m in layers)


def test_engine_batches_and_preempts_with_int8_activations(tiny_checkpoint):
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 511, (int(n),), generator=generator).tolist()
               for n in torch.randint(5, 120, (16,), generator=generator)]
    greedy = SamplingParams(temperature=0, max_tokens=16)
    busy = LLM(tiny_checkpoint, quantization="int8", quantize_activations=True, num_kv_blocks=24,
               max_num_seqs=16, max_num_batched_tokens=40)
    together = busy.generate(prompts, greedy, use_tqdm=False)
    stats = busy.stats()
    assert stats["num_preemptions"] > 0 and stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
    alone = LLM(tiny_checkpoint, quantization="int8", quantize_activations=True, num_kv_blocks=64)
    for prompt, out in zip(prompts, together):
        assert out.token_ids == alone.generate([prompt], greedy, use_tqdm=False)[0].token_ids


def test_int8_activations_without_int8_weights_are_refused():
    with pytest.raises(ValueError, match="--quantize-activations applies to --quantization int8"):
        EngineConfig(quantize_activations=True)
    with pytest.raises(ValueError, match="--quantize-activations applies to --quantization int8"):
        EngineConfig(quantization="int4", quantize_activations=True)
    assert EngineConfig(quantization="int8", quantize_activations=True).quantize_activations


@pytest.mark.parametrize("int8_dot", [True, False])
def test_int8_rows_take_the_path_their_count_and_the_cpu_choose(monkeypatch, int8_dot):
    """On a CPU with int8 dot products: up to 4 rows the weight-only kernel, 5 to 32 split into two int8
    halves, more dequantize + GEMM. Without: the kernel up to 16 rows, then dequantize + GEMM
    (quantization/int8.py). --quantize-activations: every row count rounded to int8 once."""
    monkeypatch.setattr(Int8Linear, "rounds_batches", int8_dot)
    torch.manual_seed(0)
    layer = Int8Linear.from_float(nn.Linear(40, 24))  # 40: no multiple of 16, so the rows get padded
    bias = layer.bias
    for rows in (1, 4, 5, 16, 17, 32, 33):  # fp32 rows: each path rounds them its own way, so none coincide
        x = torch.randn(rows, 40)
        padded = torch.nn.functional.pad(x, (0, 8))
        paths = {
            "kernel": layer.kernel(x) + bias,
            "split": split_int8_mm(padded, layer.qweight, layer.scales) + bias,
            "rounded": dynamic_int8_mm(padded, layer.qweight, layer.scales) + bias,
            "gemm": layer.gemm(x),
        }
        if int8_dot:
            want = "kernel" if rows <= 4 else "split" if rows <= 32 else "gemm"
        else:
            want = "kernel" if rows <= 16 else "gemm"
        assert [name for name, out in paths.items() if torch.equal(layer(x), out)] == [want], rows
        layer.quantize_activations = True
        assert [name for name, out in paths.items() if torch.equal(layer(x), out)] == ["rounded"], rows
        layer.quantize_activations = False


def test_rows_split_into_two_int8_halves_are_as_exact_as_bf16_rows():
    """split_int8_mm holds each row to ~1.6e-5 of its largest value: its result is as close to the float
    matmul as the weight-only kernel's (bf16 rows), where rounding the rows once is ~3x further off; and
    a row's result does not depend on the rows beside it."""
    torch.manual_seed(0)
    linear = nn.Linear(768, 256, bias=False)
    layer = Int8Linear.from_float(linear)
    x = torch.randn(16, 768) * torch.rand(16, 1) * 10  # rows of different sizes
    exact = x @ layer.dequantized(torch.float32).t()  # (16, 256)
    split = relative_error(split_int8_mm(x, layer.qweight, layer.scales), exact)
    assert split < 1e-4
    assert split < relative_error(dynamic_int8_mm(x, layer.qweight, layer.scales), exact) / 10
    y = split_int8_mm(x.bfloat16(), layer.qweight, layer.scales)
    assert relative_error(y, exact) < 2 * relative_error(layer.kernel(x.bfloat16()), exact)
    for i in (0, 7, 15):
        assert torch.equal(split_int8_mm(x[i : i + 1].bfloat16(), layer.qweight, layer.scales)[0], y[i])
