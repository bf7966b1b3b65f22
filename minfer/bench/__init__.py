"""The pieces of `python bench.py`, one concept per file.

workload.py   what to send: prompt and output lengths, prompts, arrival times
metrics.py    per-request records -> vLLM-style summary (TTFT, TPOT, ITL, E2EL) and its table
offline.py    drive minfer's OnlineScheduler in-process, requests arriving over time
online.py     start `python -m minfer.serve` (or use any OpenAI-compatible server), stream from threads
hf_baseline.py  the same workload through transformers' generate, in static batches
roofline.py   the batch-1 decode floor: weight bytes / measured memory bandwidth
trace.py      a Chrome/Perfetto trace of a run: request spans and per-step counters
"""
