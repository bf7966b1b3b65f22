#!/usr/bin/env bash
# minfer's whole GPU check in one call of the device tool: at most 9 minutes on an H100 or H200.
#
#     bash scripts/gpu_check.sh                       # on the GPU machine: logs and the table in $OUT
#     MINFER_DEVICE=cpu bash scripts/gpu_check.sh     # a dry run on a CPU: tiny shapes, in under 2 minutes
#
# Five steps, in order of value, each under a cap of its own (seconds), each logging to $OUT/NN_step.log;
# the run ends with a PASS/FAIL/SKIP table (also $OUT/table.txt). A step over its cap is a FAIL, and the
# next step runs. Nothing is installed but a carried llguidance (below): minfer runs from this checkout
# (PYTHONPATH) on random checkpoints it writes, offline (HF_HUB_OFFLINE=1); the GPU machine's image has torch,
# triton, transformers, tokenizers, safetensors and pytest (.library/device/KINDS.md).
#   1. env      the GPU, driver, torch, triton, CUDA                                                  10 s
#   2. flex     flex's warm-up on GPT-2's and Qwen3's shapes: seconds, error, compiles, peak memory   90 s
#   3. engines  tiny GPT-2 (fp32) and Qwen3 (bf16) engines against --enforce-eager                   120 s
#   4. tests    pytest on the GPU-ready test files, the GPU's default backend, no -x                  200 s
#   5. qwen3    Qwen3-0.6B's shape: batch-1 TPOT (graphs, eager, roofline), attention A/B at
#               256 x 1024 (flex against gather + sdpa), nano-vllm's workload (256 requests)        150 s
# A dry run (MINFER_DEVICE=cpu) runs each on tiny shapes, flex traced by Dynamo's eager backend; step 4,
# which needs CUDA, only checks that its tests are still there and prints SKIP. tests/rooms/gpu/test_gpu_check.py
# runs the dry run.
set -uo pipefail
cd "$(dirname "$0")/.."
export MINFER_DEVICE=${MINFER_DEVICE:-cuda}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
dry=false scale=1
if [[ $MINFER_DEVICE == cpu ]]; then
    dry=true scale=2  # twice the caps: CI's CPUs are shared, and the dry run's time is not what it checks
    # A fixed thread count: a new one would recompile flex (Dynamo guards on it), which a GPU never sees.
    export MINFER_NUM_THREADS=${MINFER_NUM_THREADS:-2}
fi
# The GPU machine's image lacks llguidance, a runtime dependency (structured outputs): carry its wheel in .whl
# (`pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_31_x86_64
# -d .whl llguidance==1.9.1`, the device call's carry naming .whl) and it is installed here, outside the image.
if ! $dry && compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
        export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
rows=()
started=$SECONDS

# step NAME CAP LOG COMMAND...: run it under its cap (then SIGINT: pytest still prints its summary), its
# output to LOG, and add the table's row: from its last "RESULT: STATUS what" line, else from pytest's
# summary line and the exit status.
step() {
    local name=$1 cap=$2 log=$3
    shift 3
    local start=$SECONDS line summary
    timeout --signal=INT --kill-after=10 "$cap" "$@" >>"$log" 2>&1
    local rc=$? seconds=$((SECONDS - start))
    line=$(grep -a '^RESULT: ' "$log" | tail -n 1 | cut -c9-)
    summary=$(grep -aE '^=* ?[0-9]+ (passed|failed|errors?)' "$log" | tail -n 1 | tr -d '=')
    if [[ $rc == 124 || $rc == 137 ]]; then
        line="FAIL over its ${cap} s cap: ${line:-${summary:-no result}}"
    elif [[ -z $line && $rc == 0 ]]; then
        line="PASS ${summary:-done}"
    elif [[ -z $line ]]; then
        line="FAIL exited $rc: ${summary:-see $(basename "$log")}"
    fi
    row "$name" "${line%% *}" "$seconds" "$cap" "${line#* }"
    echo "== $name: $line"
}

row() {  # name status seconds cap what
    rows+=("$(printf '%-8s %-5s %4d/%-4d %s' "$@")")
}

if ! $dry; then  # the Qwen3-0.6B-shaped checkpoint for step 5, written on the CPU while the GPU works
    qwen3_dir=$(dirname "$(mktemp -u)")/minfer-gpu-check-qwen3-0.6b
    [[ -f $qwen3_dir/config.json ]] || $PY -m minfer.random_model "$qwen3_dir" --config qwen3-0.6b \
        >"$OUT/05_qwen3.log" 2>&1 &
    writer=$!
fi

step env $((10 * scale)) "$OUT/01_env.log" $PY scripts/gpu_check.py env
step flex $((90 * scale)) "$OUT/02_flex.log" $PY scripts/gpu_check.py flex
step engines $((120 * scale)) "$OUT/03_engines.log" $PY scripts/gpu_check.py engines

tests=(tests/rooms/gpu/test_cuda.py tests/rooms/compiled/test_decode_graphs.py tests/rooms/compiled/test_flex_attention.py
    tests/core/test_gpt2.py tests/core/test_llama.py tests/core/test_model_contract.py tests/core/test_allocator.py
    tests/core/test_prefix_cache.py tests/core/test_paged_attention.py tests/core/test_batcher.py
    tests/core/test_scheduler.py tests/core/test_runner.py tests/core/test_sampler.py tests/core/test_sampling_params.py
    tests/rooms/scoring/test_logprobs.py tests/rooms/parallel_sampling/test_parallel_sampling.py
    tests/rooms/speculative/test_speculative_draft.py
    tests/architecture/test_entry_points.py::test_generate_cli_streams_the_engine_output
    tests/assembly/test_engine_config.py::test_auto_dtype_follows_the_hardware)
if $dry; then  # the CPU runs these files in CI: here only whether each file, and each test named, is still there
    start=$SECONDS missing=()
    for t in "${tests[@]}"; do
        file=${t%%::*}
        [[ -f $file && ($t != *::* || -n $(grep -m 1 "^def ${t##*::}(" "$file")) ]] || missing+=("$t")
    done
    status=SKIP found="${#tests[@]} test paths found"
    [[ ${#missing[@]} == 0 ]] || status=FAIL found="not found: ${missing[*]}"
    echo "$found" >"$OUT/04_tests.log"
    row tests $status $((SECONDS - start)) $((200 * scale)) "needs CUDA (the CPU runs these in CI): $found"
else  # on the GPU's default: FlexAttention and CUDA graphs (the tests default to eager, tests/conftest.py)
    step tests 200 "$OUT/04_tests.log" env MINFER_ATTENTION_BACKEND=auto \
        $PY -m pytest -q -p no:cacheprovider -rfE "${tests[@]}"
fi

$dry || wait "$writer"
step qwen3 $((120 * scale)) "$OUT/05_qwen3.log" $PY scripts/gpu_check.py qwen3
if $dry; then
    shape="8 x 128" ab=(--device cpu --seqs 8 --context 128 --heads 4 --kv-heads 2 --head-dim 16 --dtype float32
        --repeats 3 --backends torch,cpu_tiled)
else  # decode attention alone, one layer of Qwen3-0.6B's: gather + sdpa (torch) against flex as served, and flex
    # compiled for this one shape (its split-key decoding kernel, which the engine's dynamic compile never picks); each
    # prints as it ends, so a cap reached in the last still leaves the first two
    shape="256 x 1024" ab=(--device cuda --seqs 256 --context 1024 --backends torch,flex,flex-static)
fi
{ timeout --signal=INT $((40 * scale)) $PY scripts/attention_ab.py "${ab[@]}" || echo "attention_ab: exit $?"; } >>"$OUT/05_qwen3.log" 2>&1
speeds=$(grep -aE '^  [a-z_]+ +[0-9.]+ ms' "$OUT/05_qwen3.log" | awk '{print $1, $4, "GB/s"}' | paste -sd ',' -)
rows[-1]+="; attention at $shape: ${speeds:-none (see 05_qwen3.log)}"
$dry || [[ $speeds == *flex* ]] || rows[-1]=${rows[-1]/PASS/FAIL}  # flex did not run: say so

{
    echo "==================== minfer gpu_check ($($dry && echo "dry run, CPU" || echo GPU)): $((SECONDS - started)) s"
    printf '%-8s %-5s %-9s %s\n' step result 's/cap' 'what'
    printf '%s\n' "${rows[@]}"
} | tee "$OUT/table.txt"
echo "logs: $OUT"
! grep -q '^[a-z0-9]* *FAIL' "$OUT/table.txt"
