"""Stage 17: quantized weights. At batch 1 a decode step reads every weight once, so fewer bytes
per weight is a faster step; this script measures what int8 and int4 cost in accuracy.

It loads the GPT-2 of the other stages and: counts the bytes a decode step reads in fp32, bf16, int8
and int4; quantizes one weight per channel and per group and measures the error of each; measures
what quantizing the whole model does to its next-token distributions; times the quantized kernel
against dequantize + matmul at one row and at many (printed, not asserted: timings are noisy);
and runs the engine with --quantization int8.

    python tutorials/17_quantization.py   # MINFER_MODEL=/path to choose the checkpoint
"""


import torch
import torch.nn.functional as F
from _common import model_path, section
from _timing import BUSY_MACHINE, claim, interleaved, show

from minfer import LLM, SamplingParams
from minfer.models.registry import load_model
from minfer.quantization import Int4Linear, Int8Linear, quantize_int4, quantize_int8, quantize_model
from minfer.quantization.int4 import dequantize_int4
from minfer.quantization.int8 import dequantize_int8

torch.manual_seed(0)
path = model_path()
model = load_model(path)
linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
params = sum(p.numel() for p in model.parameters())

section("1. at batch 1, bytes are the bound")
source = torch.ones(32 * 2**20 // 4)
read = interleaved({"a 32 MiB sum": source.sum}, rounds=7)["a 32 MiB sum"]
bandwidth = source.numel() * 4 / read.median
print(f"{params:,} weights; reading memory at ~{bandwidth / 1e9:.1f} GB/s here (a 32 MiB sum: {read})")
for name, bits in (("fp32", 32), ("bf16", 16), ("int8", 8 + 32 / 768), ("int4, group 64", 4 + 64 / 64)):
    nbytes = params * bits / 8  # scales included: int8 one fp32 per row of ~768, int4 two per 64 weights
    print(f"  {name:<15} {nbytes / 1e6:8.1f} MB  -> floor {nbytes / bandwidth * 1e3:7.3f} ms/token")

section("2. one scale per output channel (int8) vs one per group (int4)")
weight = max(linears, key=lambda m: m.weight.numel()).weight.detach()  # (out, in)
rms = weight.pow(2).mean().sqrt()


def relative_rms_error(approx: torch.Tensor) -> float:
    return ((approx - weight).pow(2).mean().sqrt() / rms).item()


errors = {"int8, per channel": relative_rms_error(dequantize_int8(*quantize_int8(weight)))}
for group in (32, 64, 128):
    restored = dequantize_int4(*quantize_int4(weight, group))[:, : weight.shape[1]]
    errors[f"int4, group {group}"] = relative_rms_error(restored)
for name, error in errors.items():
    print(f"  {name:<18} RMS error {error:.2%} of the RMS weight")
# 4 bits have 16 levels, 8 bits 255: int4's step is ~16x int8's, so its error is far larger...
assert errors["int8, per channel"] < errors["int4, group 32"] / 4
# ...and smaller groups fit the weights more closely: each group's range is narrower.
assert errors["int4, group 32"] <= errors["int4, group 64"] <= errors["int4, group 128"] * 1.02

section("3. the error each adds to the model's output")
ids = torch.randint(0, model.config.vocab_size, (1, min(64, model.config.max_positions)))
kl_of = {}
with torch.inference_mode():
    reference = F.log_softmax(model(ids).float(), dim=-1)
    for method, group in (("int8", None), ("int4", 32), ("int4", 64), ("int4", 128)):
        quantized = quantize_model(load_model(path), method, group)
        logprobs = F.log_softmax(quantized(ids).float(), dim=-1)
        kl = F.kl_div(logprobs, reference, log_target=True, reduction="batchmean").item() / ids.shape[1]
        agree = (logprobs.argmax(-1) == reference.argmax(-1)).float().mean().item()
        label = method + ("" if group is None else f" g{group}")
        print(f"  {label:<9} KL(float || quantized) {kl:.2e} nats/token, same top token at {agree:.0%} of positions")
        kl_of[label] = kl
        assert method != "int8" or agree > 0.8  # (a random model's flat distributions flip easily at 4 bits)
assert kl_of["int8"] < min(kl_of["int4 g32"], kl_of["int4 g64"], kl_of["int4 g128"])  # 8 bits: far closer

section("4. why batches need another path")
linear = max(linears, key=lambda m: m.weight.numel())
for name, layer in (("int8", Int8Linear.from_float(linear)), ("int4", Int4Linear.from_float(linear, 64))):
    for rows in (1, 64):
        x = torch.randn(rows, linear.in_features)
        y_kernel, y_dequant = layer.kernel(x), x @ layer.dequantized(x.dtype).t()
        # the same matmul, two ways, to bf16's rounding: the kernel reads fp32 rows as bf16 (its fast path)
        assert (y_kernel - y_dequant).abs().max() <= 1e-2 * y_dequant.abs().max()
        print(f"  {name}, {rows} row{'s' * (rows > 1)}:")
        timings = interleaved(
            {"kernel": lambda layer=layer, x=x: layer.kernel(x),
             "dequantize + matmul": lambda layer=layer, x=x: x @ layer.dequantized(x.dtype).t()},
            rounds=7,
        )
        show(timings, width=22, indent="    ")
        if rows > 1:  # the kernel re-reads the weight every few rows: past a few rows, dequantizing once wins
            claim(timings, "dequantize + matmul", "kernel", f"at {rows} rows dequantizing once beats the kernel",
                  "On a small layer the weight stays in cache however often the kernel reads it, which hides "
                  "its re-reads. " + BUSY_MACHINE, indent="    ")

section("5. the engine, quantized")
prompt, greedy = "Once upon a time", SamplingParams(temperature=0, max_tokens=16)
for method in (None, "int8", "int4"):
    llm = LLM(path, quantization=method)
    out = llm.generate([prompt], greedy, use_tqdm=False)[0]
    stored = sum(p.numel() * p.element_size() for p in llm.model.parameters())
    print(f"  {method or 'fp32':<5} {stored / 1e6:7.2f} MB of weights: {out.text!r}")
    assert len(out.token_ids) == 16
