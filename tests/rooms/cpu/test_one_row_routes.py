"""scripts/one_row_routes.py: the one-row linear routes it times compute the matmul they stand for."""

import importlib.util
import sys
from pathlib import Path

import torch

from minfer.quantization.int8 import Int8Linear

SCRIPT = Path(__file__).parents[3] / "scripts" / "one_row_routes.py"


def load_script():
    spec = importlib.util.spec_from_file_location("one_row_routes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_int8_byte_plane_gemv_is_the_dequantized_matmul():
    """Bytes read as fp32 words and widened through the mantissa of 2**23: every int8 value, -128 to 127,
    comes back exactly (the function runs eagerly here; the script compiles the same code)."""
    routes = load_script()
    torch.manual_seed(0)
    layer = Int8Linear.from_float(torch.nn.Linear(256, 40, bias=False))
    layer.qweight.data[0, :256] = torch.arange(-128, 128, dtype=torch.int8)  # every byte value once
    x = torch.randn(1, 256)
    planes = x.view(-1, 4).t().contiguous()  # (4, K/4)
    words = layer.qweight.detach()[:, :256].contiguous().view(torch.float32)
    got = routes.int8_gemv(planes, words, layer.scales.detach())
    want = (x @ layer.dequantized(torch.float32).t())[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(routes.fp32_gemv(x[0], torch.eye(256)[:40]), x[0, :40])


def test_the_script_prints_a_row_a_shape_with_every_eager_route(monkeypatch, capsys):
    routes = load_script()
    # As with two threads (the split route is made for two), without changing this process's thread count.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)
    monkeypatch.setattr(sys, "argv", ["one_row_routes.py", "--models", "tiny", "--stream-mb", "0.1", "--no-compile"])
    routes.main()
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("| tiny"))
    assert [cell.strip() for cell in header.strip("|").split("|")][1:] == [
        "fp32 prepacked", "fp32 split along the input", "fp32 F.linear", "fp32 x @ W(in, out)",
        "int8 torch kernel (bf16 rows)", "int8 x int8 _int_mm (row rounded)",
        *(["int8 x int8 x86 linear_dynamic"] if torch.backends.quantized.engine == "x86" else [])]
    rows = [line for line in lines if line.startswith("| (")]
    assert [row.split("|")[1].strip() for row in rows] == ["(64, 96)", "(128, 64)"]
    for row in rows:
        for cell in row.strip("|").split("|")[1:]:
            us, rate = cell.split()
            assert float(us) > 0 and float(rate.strip("()")) > 0
