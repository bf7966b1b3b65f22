"""Every tutorial script runs to the end (its own asserts pass) on two random GPT-2 shapes, one
with a short context, and on minfer-tiny; every stage has its chapter and its script, and the index
links them all."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest

from minfer.models.loader import ModelNotFoundError

TUTORIALS = Path(__file__).resolve().parent.parent / "tutorials"
SCRIPTS = sorted(TUTORIALS.glob("[0-9][0-9]_*.py"))
STAGES = [
    "01_gpt2_forward",
    "02_loading_weights",
    "03_kv_cache_generation",
    "04_sampling",
    "05_tokenizer_streaming",
    "06_static_batching",
    "07_block_allocator",
    "08_paged_attention",
    "09_prefix_caching",
    "10_online_scheduler",
    "11_scheduler_manager",
    "12_http_server",
    "13_benchmarking",
    "14_modern_llm",
    "15_scoring_text",
    "16_parallel_sampling",
    "17_quantization",
    "18_speculative_decoding",
    "19_constrained_decoding",
]
# Every stage takes its sizes from the checkpoint's config: it must run on any GPT-2 shape. And on
# minfer-tiny, the shipped trained model: the tutorials' fallback when gpt2 is out of reach (None here).
SHAPES = {
    "tiny": {},  # 2 layers, 4 heads, 64 channels, a 512-token context
    "short": dict(n_positions=128, n_head=3, n_embd=48, n_layer=3),  # the shortest context supported
    "minfer-tiny": None,  # 4 layers, 4 heads, 128 channels, a 512-token context
}
TEST_NAME = "test_tutorial_script_runs"


@pytest.fixture(scope="session")
def script_runs(request, make_checkpoint, tmp_path_factory):
    """Start the selected (shape, script) runs in the background, two at a time, each in a process of
    its own forked by tests/script_forks.py: most of each script's few seconds would otherwise be
    importing torch, once per run. Two at once keep two cores busy."""
    selected = [
        (item.callspec.params["shape"], item.callspec.params["script"])
        for item in request.session.items
        if getattr(item, "originalname", None) == TEST_NAME
    ]
    if not selected:
        yield {}
        return
    checkpoints = {
        shape: "minfer-tiny" if SHAPES[shape] is None else make_checkpoint("tiny", **SHAPES[shape])
        for shape, _ in selected
    }
    # Later stages run more of the engine and take longer: start them first, so the run
    # does not end with one long script on one core while the other sits idle.
    keys = sorted(selected, key=lambda key: key[1], reverse=True)
    out = tmp_path_factory.mktemp("tutorial-runs")
    jobs = [
        {
            "script": str(script),
            "env": {"MINFER_MODEL": str(checkpoints[shape])},
            "stdout": str(out / f"{shape}-{script.stem}.out"),
            "stderr": str(out / f"{shape}-{script.stem}.err"),
            "timeout": 180,
        }
        for shape, script in keys
    ]
    (out / "jobs.json").write_text(json.dumps(jobs))
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",  # two scripts at once on a small machine: don't oversubscribe it
    }
    forks = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("script_forks.py")), str(out / "jobs.json")],
        cwd=TUTORIALS.parent, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    futures = {key: Future() for key in keys}

    def collect():
        for line in forks.stdout:
            done = json.loads(line)
            job = jobs[done["index"]]
            futures[keys[done["index"]]].set_result(subprocess.CompletedProcess(
                job["script"],
                done["returncode"],
                Path(job["stdout"]).read_text(errors="replace"),
                Path(job["stderr"]).read_text(errors="replace"),
            ))
        forks.wait()
        for future in futures.values():  # the forking process itself died: say so in every test left
            if not future.done():
                future.set_result(subprocess.CompletedProcess(
                    "tests/script_forks.py", -1, "", f"tests/script_forks.py exited with {forks.returncode}"
                ))

    collector = threading.Thread(target=collect, daemon=True)
    collector.start()
    yield futures
    if forks.poll() is None:  # after -x: stop the runs nobody will check, children included
        os.killpg(forks.pid, signal.SIGKILL)
    collector.join()


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
@pytest.mark.parametrize("shape", SHAPES)
def test_tutorial_script_runs(script_runs, shape, script):
    result = script_runs[shape, script].result()
    assert result.returncode == 0, (
        f"{script.name} on the {shape} checkpoint {SHAPES[shape]} exited with {result.returncode}\n"
        f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
    )
    assert result.stdout.strip(), f"{script.name} printed nothing"


def test_model_path_order(monkeypatch, tiny_checkpoint, capsys):
    """MINFER_MODEL first; then gpt2; with no gpt2 to be had, minfer-tiny, which ships with minfer."""
    monkeypatch.syspath_prepend(str(TUTORIALS))
    import _common

    from minfer.models import loader

    monkeypatch.setenv("MINFER_MODEL", str(tiny_checkpoint))
    assert _common.model_path() == str(tiny_checkpoint)

    resolve = loader.resolve_model_dir

    def no_hub(name):
        if name in loader.BUILTIN_MODELS:
            return resolve(name)
        raise ModelNotFoundError(f"could not get model {name!r} (test)")

    monkeypatch.delenv("MINFER_MODEL")
    monkeypatch.setattr("minfer.models.loader.resolve_model_dir", no_hub)
    assert _common.model_path() == str(loader.BUILTIN_MODELS["minfer-tiny"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "MINFER_MODEL" in lines[0] and "minfer-tiny" in lines[1]


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_has_a_chapter_and_a_script(stage):
    for suffix in (".md", ".py"):
        assert (TUTORIALS / (stage + suffix)).is_file(), f"tutorials/{stage}{suffix} is missing"


def test_no_stray_stage_files():
    """Every numbered file belongs to a listed stage (a misspelt name would go untested here)."""
    stray = [p.name for p in TUTORIALS.glob("[0-9][0-9]_*") if p.stem not in STAGES]
    assert not stray, f"numbered files outside the stage list: {stray}"


def test_readme_links_every_stage():
    readme = (TUTORIALS / "README.md").read_text(encoding="utf-8")
    for stage in STAGES:
        assert f"]({stage}.md)" in readme, f"tutorials/README.md does not link {stage}.md"


def test_relative_links_in_chapters_point_to_files():
    for md in [TUTORIALS / "README.md", *sorted(TUTORIALS.glob("[0-9][0-9]_*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", md.read_text(encoding="utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (md.parent / target).exists(), f"{md.name} links {target}, which does not exist"
