"""lm-evaluation-harness against minfer, unchanged: `local-completions` pointed at minfer's server versus
`hf` (transformers) on the same checkpoint, minfer-tiny in fp32, on a local task set (lm_eval_task.py):
multiple choice, rolling perplexity and greedy generate_until. Per-sample loglikelihoods agree within
1e-4, is_greedy agrees, and the generations are identical. The harness finds minfer's tokenizer by
itself (tokenizer_backend=auto: /tokenizer_info and /tokenize) and sends batches of 4 prompts."""

import os
import threading

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the task data is local; nothing may reach the Hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from lm_eval.tasks import TaskManager
from lm_eval_task import TASKS, write_tasks

from minfer import EngineConfig
from minfer.models.loader import resolve_model_dir
from minfer.server.serve import create_server

WINDOW = 64  # hf's max_length; local-completions keeps 2 tokens back (one to draw, one for its count)
TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint():
    return resolve_model_dir("minfer-tiny")


@pytest.fixture(scope="module")
def server(checkpoint):
    srv = create_server(EngineConfig(str(checkpoint), dtype="float32", num_kv_blocks=64), port=0)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield srv
    srv.stop(grace=1.0)


def evaluate(model: str, model_args: str, tasks_dir) -> dict:
    # Our tasks only: indexing lm-eval's own thousands of task files took 10 s of CPU a call.
    manager = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS, task_manager=manager, device="cpu")
    return {task: [s["resps"] for s in out["samples"][task]] for task in TASKS}


def test_local_completions_agrees_with_hf(server, checkpoint, tmp_path):
    tasks_dir = write_tasks(tmp_path / "tasks")
    host, port = server.server_address[:2]
    url = f"http://{host}:{port}/v1/completions"
    ours = evaluate(
        "local-completions", f"base_url={url},model={server.info.name},max_length={WINDOW + 2},batch_size=4", tasks_dir
    )
    ref = evaluate("hf", f"pretrained={checkpoint},dtype=float32,max_length={WINDOW},batch_size=4", tasks_dir)

    mc = [(a[0], b[0]) for doc_a, doc_b in zip(ours["minfer_mc"], ref["minfer_mc"]) for a, b in zip(doc_a, doc_b)]
    assert len(mc) == 18
    for (ll, greedy), (ref_ll, ref_greedy) in mc:
        assert abs(ll - ref_ll) < TOL and greedy == ref_greedy
    assert sum(greedy for (_, greedy), _ in mc) >= 4, "the right choices are minfer-tiny's greedy continuations"

    assert len(ours["minfer_ppl"]) == 3
    for [[ll]], [[ref_ll]] in zip(ours["minfer_ppl"], ref["minfer_ppl"]):
        assert abs(ll - ref_ll) < TOL  # the long texts span several windows

    assert ours["minfer_gen"] == ref["minfer_gen"]
    assert all(len(text) > 10 for [[text]] in ours["minfer_gen"])
    stats = server.manager.stats()
    assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
