"""The steps of scripts/gpu_check.sh, one per call: `python scripts/gpu_check.py STEP`.

    env      the GPU, its driver, torch, triton and CUDA
    flex     flex's warm-up on GPT-2's and Qwen3's attention shapes: seconds, error against the plain
             backend, compiles, peak memory
    engines  random tiny GPT-2 (fp32) and Qwen3 (bf16) engines, the default against --enforce-eager: the
             same greedy tokens over 16 prompts with a shared prefix and one long prompt; backend, graphs,
             start-up seconds, recompiles after the warm-up, fallbacks, peak memory against the budget
    qwen3    a Qwen3-0.6B-shaped random checkpoint: batch-1 TPOT with graphs and eager beside the roofline,
             then 64 requests of nano-vllm's workload shape (100-1024 tokens in and out)

Each prints what it measured and ends with one line, `RESULT: PASS|FAIL|SKIP what`, for the script's
table. With MINFER_DEVICE=cpu each is a dry run on tiny shapes, flex traced by Dynamo's eager backend
(compiled/flex_kernel.py's serving path: the same guards, no kernels): it checks this script, not speed.
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minfer import settings  # noqa: E402  (each step imports the rest: `env` must start in seconds)
from minfer.compiled import flex_kernel  # noqa: E402

DEVICE = torch.device(settings.DEVICE.get("cuda"))
DRY = DEVICE.type != "cuda"
GiB = 2**30
# (heads, kv heads, head dim, dtype) of the models whose attention flex must serve
FLEX_SHAPES = {"gpt2": (12, 12, 64, torch.float32), "qwen3": (16, 8, 128, torch.bfloat16)}
QWEN3_DIR = Path(tempfile.gettempdir()) / "minfer-gpu-check-qwen3-0.6b"  # gpu_check.sh writes it ahead


def result(status: str, what: str) -> int:
    print(f"RESULT: {status} {what}", flush=True)
    return 0 if status != "FAIL" else 1


def compiles() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]  # Dynamo's graphs compiled in this process


def reset_peak() -> None:
    if not DRY:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / GiB if not DRY else 0.0


# ---- 1. the environment ---------------------------------------------------------------------


def env() -> int:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    torch_line = f"torch {torch.__version__}, triton {triton_version}, Python {platform.python_version()}"
    print(torch_line)
    if too_old := flex_kernel.torch_too_old():
        return result("FAIL", too_old)
    if DRY:
        return result("PASS", f"dry run on the CPU ({platform.processor() or platform.machine()}); {torch_line}")
    if not torch.cuda.is_available():
        return result("FAIL", f"MINFER_DEVICE={DEVICE} but torch sees no CUDA GPU; {torch_line}")
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True)
    name, props = torch.cuda.get_device_name(), torch.cuda.get_device_properties(DEVICE)
    gpu = f"{name} ({props.total_memory / GiB:.0f} GiB, sm_{props.major}{props.minor}), driver {smi.stdout.strip()}"
    return result("PASS", f"{gpu}; {torch_line}, CUDA {torch.version.cuda}")


# ---- 2. flex's warm-up ----------------------------------------------------------------------


def flex() -> int:
    from minfer.compiled.flex import FlexBackend

    notes, failed = [], False
    for name, (heads, kv_heads, head_dim, dtype) in FLEX_SHAPES.items():
        backend = FlexBackend(DEVICE, dtype)
        reset_peak()
        before = compiles()
        start = time.perf_counter()
        why_not = backend.warm_up(heads, kv_heads, head_dim, 16)
        seconds, compiled = time.perf_counter() - start, compiles() - before
        if why_not:
            failed = True
            notes.append(f"{name}: off ({why_not})")
            continue
        error = error_against_plain(backend, heads, kv_heads, head_dim)
        tolerance = 1e-4 if dtype == torch.float32 else 3e-2
        failed |= not error <= tolerance
        memory = f", peak {peak_gib():.2f} GiB" if not DRY else ""
        line = f"{name} {str(dtype)[6:]}: {seconds:.1f} s, error {error:.1e}, {compiled} compiles{memory}"
        print(line, flush=True)
        notes.append(line)
    return result("FAIL" if failed else "PASS", "; ".join(notes))


@torch.inference_mode()
def error_against_plain(backend, heads: int, kv_heads: int, head_dim: int, seqs: int = 16, context: int = 300) -> float:
    """Decode attention of `seqs` sequences over shuffled blocks, flex against the plain backend: max |error|."""
    from minfer.attention.kv_cache import cdiv
    from minfer.attention.backend import StepLayout
    from minfer.attention.torch_sdpa import TorchBackend

    B, dtype, gen = 16, backend.dtype, torch.Generator().manual_seed(1)
    lens = [random.Random(s).randint(2, context) for s in range(seqs)]
    num_blocks = sum(cdiv(n, B) for n in lens)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in lens:
        tables.append(order[at : at + cdiv(n, B)])
        at += cdiv(n, B)
    shape = argparse.Namespace(num_layers=2, num_kv_heads=kv_heads, head_dim=head_dim)
    with torch.inference_mode(False):
        cache = backend.new_cache(shape, num_blocks, B, DEVICE, dtype)
        written = cache.kv[:, : num_blocks * B]
        written.copy_(torch.randn(written.shape, generator=gen).to(DEVICE, dtype))
    slots = torch.tensor([t[(n - 1) // B] * B + (n - 1) % B for t, n in zip(tables, lens)], device=DEVICE)
    layout = StepLayout(slots, list(range(seqs)), [1] * seqs, lens, tables, B, num_blocks)
    q = torch.randn(seqs, heads, head_dim, generator=gen).to(DEVICE, dtype)
    k, v = cache.kv[1, slots, 0], cache.kv[1, slots, 1]
    plain = TorchBackend(DEVICE, dtype)
    got = backend.forward(q, k, v, cache.kv[1], backend.build_metadata(layout), head_dim**-0.5)
    want = plain.forward(q, k, v, cache.kv[1].clone(), plain.build_metadata(layout), head_dim**-0.5)
    return (got.float() - want.float()).abs().max().item()


# ---- 3. tiny engines against --enforce-eager -----------------------------------------------


def engine_prompts(vocab: int) -> list[list[int]]:
    """16 prompts sharing a 48-token prefix (prefix hits), and one long prompt (chunked prefill)."""
    rng = random.Random(0)
    shared = [rng.randrange(vocab) for _ in range(48)]
    prompts = [shared + [rng.randrange(vocab) for _ in range(rng.randint(3, 40))] for _ in range(16)]
    return prompts + [[rng.randrange(vocab) for _ in range(400)]]


def engines() -> int:
    from minfer.checkpoints import write_random_checkpoint

    notes, failed = [], False
    with tempfile.TemporaryDirectory() as tmp:
        for name, preset, dtype in (("gpt2", "tiny", "float32"), ("qwen3", "qwen3-tiny", "bfloat16")):
            checkpoint = write_random_checkpoint(Path(tmp) / name, preset)
            ok, line = compare_engines(str(checkpoint), dtype)
            print(f"{name} {dtype}: {line}", flush=True)
            failed |= not ok
            notes.append(f"{name}: {line}")
    return result("FAIL" if failed else "PASS", "; ".join(notes))


def compare_engines(checkpoint: str, dtype: str) -> tuple[bool, str]:
    from minfer import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=48 if not DRY else 8, temperature=0, ignore_eos=True, logprobs=2)
    # A dry run's flex is unfused (traced, no kernels): it scores every slot of the cache, so a small one.
    common = dict(dtype=dtype, max_num_seqs=32, max_num_batched_tokens=256, **({"num_kv_blocks": 160} if DRY else {}))
    eager = LLM(checkpoint, enforce_eager=True, **common)
    prompts = engine_prompts(eager.model.config.vocab_size)
    expected = eager.generate(prompts, greedy, use_tqdm=False)
    eager.close()
    del eager
    gc.collect()
    reset_peak()
    start = time.perf_counter()
    llm = LLM(checkpoint, attention_backend="auto", **common)
    startup = time.perf_counter() - start
    before = compiles()
    got = llm.generate(prompts, greedy, use_tqdm=False)
    recompiles, stats, compiled = compiles() - before, llm.stats(), llm.scheduler.runner.compiled
    equal = sum(a.token_ids == b.token_ids for a, b in zip(got, expected))
    ties = sum(diverges_at_a_tie(a, b, dtype) for a, b in zip(got, expected))
    graphs = compiled.graphs if compiled is not None else None
    graph_note = f"{len(graphs.graphs)} graphs, {graphs.num_steps} replays" if graphs is not None else "no graphs"
    budget = 0.9 * torch.cuda.get_device_properties(DEVICE).total_memory / GiB if not DRY else 0.0
    memory = f", peak {peak_gib():.2f} of {budget:.0f} GiB" if not DRY else ""
    line = (
        f"{equal}/{len(prompts)} equal" + (f" (+{ties} parting at a near tie)" if ties else "")
        + f", {llm.scheduler.attention.name}, {graph_note}, start-up {startup:.1f} s, "
        f"{recompiles} recompiles, {stats.get('num_path_fallbacks', 0)} fallbacks, "
        f"{stats['prefix_cache_hit_tokens']} prefix-hit tokens{memory}"
    )
    for line_ in (stats.get("compiled_paths") or {}).get("fallbacks", []):
        print(f"  fallback: {line_}")
    llm.close()
    within_budget = DRY or peak_gib() <= budget
    ok = equal + ties == len(prompts) and recompiles == 0 and not stats.get("num_path_fallbacks") and within_budget
    return ok, line


def diverges_at_a_tie(got, expected, dtype: str) -> bool:
    """Whether two greedy outputs part where the reference's two likeliest tokens were within rounding of each
    other: in bf16, two flex and sdpa round differently, and a random tiny model's logits are often that close."""
    tie = 1e-4 if dtype == "float32" else 2**-4  # nats: two bf16 steps of a logprob around -4 to -8
    for a, b in zip(got.logprobs, expected.logprobs):
        if a.token_id != b.token_id:
            first, second = sorted((logprob for _, logprob in b.top), reverse=True)[:2]
            return first - second <= tie
    return False


# ---- 5. Qwen3-0.6B's shape: batch-1 TPOT and throughput ----------------------------------


def qwen3() -> int:
    from minfer.assembly.build import build_engine
    from minfer.bench.metrics import summarize
    from minfer.bench.offline import run_offline
    from minfer.bench.roofline import batch1_tpot, roofline
    from minfer.bench.workload import build_workload
    from minfer.checkpoints import write_random_checkpoint
    from minfer.engine.config import EngineConfig
    from minfer.models.registry import load_model

    scratch = tempfile.TemporaryDirectory()  # the dry run's checkpoint, removed when this check returns
    checkpoint = QWEN3_DIR if not DRY else write_random_checkpoint(Path(scratch.name) / "q", "qwen3-tiny")
    if not (Path(checkpoint) / "config.json").exists():
        return result("FAIL", f"no checkpoint at {checkpoint} (gpu_check.sh writes it first)")
    model = load_model(checkpoint, device=DEVICE, dtype=torch.bfloat16)
    config = EngineConfig(str(checkpoint), dtype="bfloat16", max_num_seqs=1, num_kv_blocks=32, enforce_eager=True)
    eager = build_engine(config, model=model)
    output_len = 128 if not DRY else 8
    eager_tpot = batch1_tpot(eager, prompt_len=128, output_len=output_len) * 1000
    eager.close()
    del eager
    gc.collect()
    # nano-vllm's workload (its README: 256 requests, 100-1,024 tokens in and out), all running at once: 67 s on
    # the H200 at 2,162 tok/s. Dry: 8 tiny requests, flex running unfused, slowly.
    num_requests, output_lens = (256, "100:1024") if not DRY else (8, "4:12")
    config = EngineConfig(str(checkpoint), dtype="bfloat16", max_num_seqs=num_requests, max_num_batched_tokens=16384,
                          **({"num_kv_blocks": 32} if DRY else {}))
    engine = build_engine(config, model=model)
    figures = roofline(engine, output_len=output_len)
    print(figures, flush=True)
    workload = build_workload(num_requests, output_lens, output_lens, texts=[], tokenizer=engine.tokenizer,
                              vocab_size=model.config.vocab_size, context=model.config.max_positions,
                              rate=float("inf"), seed=0, pretok=False)
    run = run_offline(engine, workload, progress=False)
    summary = summarize(run.records, run.duration)
    paths = engine.stats().get("compiled_paths")
    print(f"{num_requests} requests: {summary['output_throughput']:.0f} output tok/s over {run.duration:.1f} s; "
          f"{paths}", flush=True)
    notes = (
        f"batch-1 TPOT {figures['measured_tpot_ms']:.2f} ms with graphs, {eager_tpot:.2f} eager, floor "
        f"{figures['floor_tpot_ms']:.2f} (matmuls {figures['matmul_floor_ms']:.2f}); {num_requests} requests of "
        f"{output_lens} in and out: {summary['output_throughput']:,.0f} output tok/s"
    )
    failed = summary["completed"] != num_requests or engine.stats().get("num_path_fallbacks")
    return result("FAIL" if failed else "PASS", notes + (" (dry run: tiny shapes)" if DRY else ""))


STEPS = {"env": env, "flex": flex, "engines": engines, "qwen3": qwen3}


def take_the_gpu_paths_on_the_cpu() -> None:
    """For a dry run: "auto" is flex as it serves on a GPU, traced by Dynamo's eager backend (no kernels to
    compile), and decode steps run through the CUDA graphs' buffers, not recorded (as tests/conftest.py's
    flex_traced_as_on_a_gpu and test_decode_graphs.py's `graphed` have them)."""
    from minfer.assembly import selector
    from minfer.compiled import cuda_graphs

    flex_kernel.SERVING_DEVICES, flex_kernel.SERVING_BACKEND = ("cuda", "cpu"), "eager"
    name = selector.backend_name
    selector.backend_name = lambda device, dtype, choice="auto", kv_width=None: (
        "flex" if choice in ("auto", "compiled") else name(device, dtype, choice, kv_width)
    )
    cuda_graphs.wants_decode_graphs = lambda device, eager, backend: not eager and backend.captures_in_graphs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=sorted(STEPS))
    step = p.parse_args().step
    if DRY:
        take_the_gpu_paths_on_the_cpu()
    try:
        return STEPS[step]()
    except Exception as e:
        import traceback

        traceback.print_exc()
        return result("FAIL", f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")


if __name__ == "__main__":
    sys.exit(main())
