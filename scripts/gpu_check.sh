#!/usr/bin/env bash
# Issue 33's checks on a lent GPU machine, in one call of the device tool:
#
#     bash scripts/gpu_check.sh tests|bench|batch1|all
#
# Each stage fits one device call (10 minutes at most); `all` runs the three, for a longer one.
#
# That machine has torch, transformers, tokenizers, safetensors and pytest, but no package
# registry and no Hub: minfer runs from this checkout (PYTHONPATH), on random checkpoints it
# writes. Logs and JSON land in $OUT (the device tool brings them back); the end of the output
# is a short summary. Stages:
#   tests: the engine, model, sampling, KV-cache and loader tests on CUDA (MINFER_DEVICE=cuda,
#          tests/conftest.py), fp32 against transformers, plus tests/test_cuda.py (one host sync
#          per step, GPU memory that does not grow, CUDA graphs against --enforce-eager). First with
#          what a GPU runs by default (FlexAttention, CUDA graphs), then the engine tests once more
#          on the plain backend. The server, browser and lm-eval tests need packages that machine
#          lacks, so they are not run there.
#   bench: decode attention alone (scripts/attention_ab.py: gather + sdpa against FlexAttention), then
#          issue 33's workloads on the Qwen3-0.6B shape in bf16: nano-vllm's (256 requests, 100-1024
#          tokens in and out) beside transformers' generate on its first requests, and batch-1 TPOT
#          beside the HBM bandwidth floor (--roofline), with CUDA graphs and with --enforce-eager.
set -uo pipefail
stage=${1:?say tests, bench, batch1 or all}
OUT=${OUT:-/tmp/gpu_check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
summary=()

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/env.txt" || exit 1

if [[ $stage == tests || $stage == all ]]; then
    tests=(tests/test_cuda.py tests/test_model.py tests/test_llama.py tests/test_engine.py tests/test_kv_cache.py
        tests/test_loader.py tests/test_layers.py tests/test_model_contract.py tests/test_sampling.py
        tests/test_sampling_controls.py tests/test_parallel_sampling.py tests/test_logprobs.py
        tests/test_speculative_draft.py tests/test_flex_attention.py tests/test_decode_graphs.py)
    MINFER_DEVICE=cuda MINFER_ATTENTION_BACKEND=auto timeout 330 $PY -m pytest -q -p no:cacheprovider -rs -x \
        "${tests[@]}" 2>&1 | tee "$OUT/tests.log"
    summary+=("tests (flex, graphs): $(tail -n 1 "$OUT/tests.log")")
    MINFER_DEVICE=cuda MINFER_ATTENTION_BACKEND=eager timeout 150 $PY -m pytest -q -p no:cacheprovider -rs \
        tests/test_engine.py tests/test_cuda.py 2>&1 | tee "$OUT/tests_eager.log"
    summary+=("tests (plain backend): $(tail -n 1 "$OUT/tests_eager.log")")
fi

if [[ $stage == bench || $stage == all ]]; then
    for shape in "256 1024" "64 4096" "1 4096"; do  # decode attention alone, one layer: gather + sdpa vs flex
        set -- $shape
        timeout 60 $PY scripts/attention_ab.py --device cuda --seqs "$1" --context "$2" --backends torch,flex \
            2>&1 | tee -a "$OUT/attention.log"
    done
    summary+=("$(grep -E '^  (torch|flex)' "$OUT/attention.log" | tr -s ' ' | paste -sd ';')")
    model=/tmp/qwen3-0.6b
    [[ -d $model ]] || $PY -m minfer.random_model "$model" --config qwen3-0.6b >/dev/null || exit 1
    common=(--model "$model" --device cuda --dtype bfloat16 --disable-tqdm --max-num-batched-tokens 8192)
    # nano-vllm's workload: every request at once, lengths drawn from 100-1024, ignore_eos (bench.py's default).
    timeout 330 $PY bench.py "${common[@]}" --num-requests 256 --input-len 100:1024 --output-len 100:1024 \
        --max-num-seqs 256 --baseline hf --hf-batch-size 32 --hf-num-requests 32 \
        --json "$OUT/nano_vllm.json" 2>&1 | tee "$OUT/nano_vllm.log"
    summary+=("256 x 100-1024: $(grep -m1 'Output token throughput' "$OUT/nano_vllm.log")")
    summary+=("  vs transformers: $(grep -A1 'minfer vs transformers' "$OUT/nano_vllm.log" | tail -n 1)")
fi

if [[ $stage == batch1 || $stage == all ]]; then
    model=/tmp/qwen3-0.6b
    [[ -d $model ]] || $PY -m minfer.random_model "$model" --config qwen3-0.6b >/dev/null || exit 1
    common=(--model "$model" --device cuda --dtype bfloat16 --disable-tqdm)
    for mode in graphs eager; do
        flags=()
        [[ $mode == eager ]] && flags=(--enforce-eager)
        timeout 240 $PY bench.py "${common[@]}" "${flags[@]}" --num-requests 4 --input-len 128 --output-len 256 \
            --max-num-seqs 1 --roofline --json "$OUT/batch1_$mode.json" 2>&1 | tee "$OUT/batch1_$mode.log"
        summary+=("batch 1 ($mode): $(grep -m1 'Mean TPOT' "$OUT/batch1_$mode.log")")
    done
fi

echo "==================== summary ===================="
printf '%s\n' "${summary[@]}"
