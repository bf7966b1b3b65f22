"""Every tutorial script runs to the end (its own asserts pass) on two random GPT-2 shapes, one
with a short context, and on minfer-tiny; every stage has its chapter and its script, and the index
links them all. The stages with an exercise run on minfer-tiny through the exercise's plug with minfer's
own code, and each unfilled stub must stop its stage with a clear sentence; the optional stage (08b)
runs once; the figures redraw from the engine as committed."""

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

TUTORIALS = Path(__file__).resolve().parents[2] / "tutorials"
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
# Optional stages: a chapter and a script, off the main path (not numbered in the index's list), run once.
OPTIONAL_STAGES = {"08b_cpu_attention": "tiny"}
# Stages with an exercise (tutorials/exercises/): on minfer-tiny they run with MINFER_EXERCISE=reference,
# minfer's own code through the exercise's plug, so the plug and the grader are tested on every run.
EXERCISES = {
    "03": ("03_kv_cache_generation", "ex03_kv_cache", "attention_with_cache"),
    "07": ("07_block_allocator", "ex07_block_allocator", "allocate"),
    "08": ("08_paged_attention", "ex08_paged_attention", "forward"),
    "09": ("09_prefix_caching", "ex09_prefix_caching", "register_full_blocks"),
    "10": ("10_online_scheduler", "ex10_scheduler", "admit"),
    "11": ("11_scheduler_manager", "ex11_worker_loop", "run"),
}
EXERCISE_SHAPE = "minfer-tiny"
STUB_SHAPE = "tiny"  # the unfilled stubs run here, until their first call stops them
TEST_NAMES = ("test_tutorial_script_runs", "test_optional_stage_runs", "test_unfilled_exercise_fails")


def exercise_of(script: Path) -> str | None:
    return next((n for n, (stem, _, _) in EXERCISES.items() if stem == script.stem), None)


def run_key_of(shape: str, script: Path) -> tuple[str, Path, str | None]:
    """A stage's run on a shape: with the reference through its exercise's plug on EXERCISE_SHAPE."""
    return shape, script, "reference" if shape == EXERCISE_SHAPE and exercise_of(script) else None


def run_key(item) -> tuple[str, Path, str | None]:
    """(shape, script, exercise source) of a selected test: what it needs run."""
    params = item.callspec.params
    if item.originalname == "test_tutorial_script_runs":
        return run_key_of(params["shape"], params["script"])
    if item.originalname == "test_optional_stage_runs":
        return OPTIONAL_STAGES[params["stage"]], TUTORIALS / f"{params['stage']}.py", None
    return STUB_SHAPE, TUTORIALS / f"{EXERCISES[params['stage']][0]}.py", "1"


@pytest.fixture(scope="session")
def script_runs(request, make_checkpoint, tmp_path_factory):
    """Start the selected (shape, script) runs in the background, two at a time, each in a process of
    its own forked by tests/script_forks.py: most of each script's few seconds would otherwise be
    importing torch and minfer, once per run (and transformers' GPT-2, for stages 01 and 15, 4 s). Two
    at once keep two cores busy."""
    selected = [run_key(item) for item in request.session.items if getattr(item, "originalname", None) in TEST_NAMES]
    if not selected:
        yield {}
        return
    checkpoints = {
        shape: "minfer-tiny" if SHAPES[shape] is None else make_checkpoint("tiny", **SHAPES[shape])
        for shape, _, _ in selected
    }
    # Later stages run more of the engine and take longer: start them first, so the run
    # does not end with one long script on one core while the other sits idle.
    keys = sorted(selected, key=lambda key: (key[1], key[2] or ""), reverse=True)
    out = tmp_path_factory.mktemp("tutorial-runs")
    tmpdirs = {key: out / f"{key[0]}-{key[1].stem}-{key[2]}.tmp" for key in keys}  # each run's TMPDIR: it must
    for folder in tmpdirs.values():  # leave it empty, or a reader's /tmp keeps what it wrote
        folder.mkdir()
    jobs = [
        {
            "argv": [str(script)],
            "env": {"MINFER_MODEL": str(checkpoints[shape]), "MINFER_EXERCISE": source or "",
                    "TMPDIR": str(tmpdirs[shape, script, source])},
            "stdout": str(out / f"{shape}-{script.stem}-{source}.out"),
            "stderr": str(out / f"{shape}-{script.stem}-{source}.err"),
            "timeout": 180,
        }
        for shape, script, source in keys
    ]
    (out / "jobs.json").write_text(json.dumps(jobs))
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",  # two scripts at once on a small machine: don't oversubscribe it
    }
    forks = subprocess.Popen(
        [sys.executable, str(Path(__file__).parents[1] / "script_forks.py"), str(out / "jobs.json"), "--preload",
         "torch,minfer,minfer.server.serve,transformers,transformers.models.gpt2.modeling_gpt2"],
        cwd=TUTORIALS.parent, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    futures = {key: Future() for key in keys}
    for key, future in futures.items():
        future.tmpdir = tmpdirs[key]

    def collect():
        for line in forks.stdout:
            done = json.loads(line)
            job = jobs[done["index"]]
            futures[keys[done["index"]]].set_result(subprocess.CompletedProcess(
                job["argv"][0],
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
    """Every stage runs to its end; a stage with an exercise runs it on minfer-tiny through the exercise's
    plug with minfer's own code (the reference), and must say every plugged function ran."""
    key = run_key_of(shape, script)
    result = script_runs[key].result()
    how = " with MINFER_EXERCISE=reference" if key[2] else ""
    assert result.returncode == 0, (
        f"{script.name}{how} on the {shape} checkpoint {SHAPES[shape]} exited with {result.returncode}\n"
        f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
    )
    assert result.stdout.strip(), f"{script.name} printed nothing"
    left = sorted(p.name for p in script_runs[key].tmpdir.iterdir())
    assert not left, f"{script.name} left {left} in its temporary folder: a reader's /tmp would keep them"
    if key[2]:
        graded = f"exercise {exercise_of(script)} graded (the reference)"
        assert graded in result.stdout, f"{script.name}{how} never printed {graded!r}: the plug did not run"


@pytest.mark.parametrize("stage", OPTIONAL_STAGES)
def test_optional_stage_runs(script_runs, stage):
    result = script_runs[OPTIONAL_STAGES[stage], TUTORIALS / f"{stage}.py", None].result()
    assert result.returncode == 0, (
        f"{stage}.py exited with {result.returncode}\n"
        f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
    )
    assert "OK:" in result.stdout


@pytest.mark.parametrize("stage", EXERCISES)
def test_unfilled_exercise_fails(script_runs, stage):
    """Each stub, as shipped, stops its stage at its first call with a sentence naming the file to fill in.
    (If you have filled a stub in, its case here fails: that is expected.)"""
    stem, module, function = EXERCISES[stage]
    result = script_runs[STUB_SHAPE, TUTORIALS / f"{stem}.py", "1"].result()
    message = f"exercise {stage}: {function} is not written yet: fill in tutorials/exercises/{module}.py"
    assert result.returncode != 0 and message in result.stderr, (
        f"{stem}.py with MINFER_EXERCISE=1 (the unfilled stub) should stop with {message!r}; it exited "
        f"{result.returncode}\n--- stdout ---\n{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-3000:]}"
    )
    assert f"exercise {stage} graded" not in result.stdout


def test_exercise_flag_on_a_stage_without_an_exercise_says_there_is_none():
    """It would run minfer's own code and pass, as if something had been graded."""
    done = subprocess.run([sys.executable, str(TUTORIALS / "04_sampling.py"), "--exercise"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr and done.stdout == "", done.stderr
    assert "stage 04 has no exercise (--exercise): stages 03, 07, 08, 09, 10, 11 have one" in done.stderr


def test_stage_15_without_transformers_says_what_to_install():
    """Stage 15 checks every number against transformers: without it (a plain install, as tutorials/README.md
    says) it stops with a sentence, not an import traceback."""
    hide = "import runpy, sys; sys.modules['transformers'] = None; sys.path.insert(0, sys.argv[1]); " \
           "runpy.run_path(sys.argv[2], run_name='__main__')"
    script = TUTORIALS / "15_scoring_text.py"
    done = subprocess.run([sys.executable, "-c", hide, str(TUTORIALS), str(script)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert 'stage 15 checks every number against transformers: pip install -e ".[tutorials]"' in done.stderr


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


@pytest.mark.parametrize("stage", OPTIONAL_STAGES)
def test_every_optional_stage_has_a_chapter_and_a_script(stage):
    for suffix in (".md", ".py"):
        assert (TUTORIALS / (stage + suffix)).is_file(), f"tutorials/{stage}{suffix} is missing"


def test_no_stray_stage_files():
    """Every numbered file belongs to a listed stage (a misspelt name would go untested here)."""
    numbered = [*TUTORIALS.glob("[0-9][0-9]_*"), *TUTORIALS.glob("[0-9][0-9][a-z]_*")]
    stray = [p.name for p in numbered if p.stem not in STAGES and p.stem not in OPTIONAL_STAGES]
    assert not stray, f"numbered files outside the stage lists: {stray}"


def test_readme_links_every_stage():
    readme = (TUTORIALS / "README.md").read_text(encoding="utf-8")
    for stage in [*STAGES, *OPTIONAL_STAGES]:
        assert f"]({stage}.md)" in readme, f"tutorials/README.md does not link {stage}.md"


@pytest.mark.parametrize("stage", EXERCISES)
def test_every_exercise_has_a_stub_and_a_plug(stage):
    """The test's table, the plug's and the stubs agree: each stub file defines, with a docstring, every
    function its plug puts in the engine, says how to run its stage, and the stage plugs it."""
    import ast

    stem, module, function = EXERCISES[stage]
    sys.path.insert(0, str(TUTORIALS))
    try:
        from exercises.plug import EXERCISES as PLUGS
    finally:
        sys.path.remove(str(TUTORIALS))
    plug = PLUGS[stage]
    assert plug.module == module and plug.seams[0].function == function, plug
    tree = ast.parse((TUTORIALS / "exercises" / f"{module}.py").read_text(encoding="utf-8"))
    stubs = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    for seam in plug.seams:
        assert seam.function in stubs, f"tutorials/exercises/{module}.py has no {seam.function}()"
        assert ast.get_docstring(stubs[seam.function]), f"{module}.{seam.function} has no docstring"
    assert f"tutorials/{stem}.py --exercise" in ast.get_docstring(tree), f"{module}'s docstring must say how to run it"
    assert f'exercise("{stage}"' in (TUTORIALS / f"{stem}.py").read_text(encoding="utf-8"), f"{stem}.py never plugs"


def test_relative_links_in_chapters_point_to_files():
    for md in [TUTORIALS / "README.md", *sorted(TUTORIALS.glob("[0-9][0-9]_*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", md.read_text(encoding="utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (md.parent / target).exists(), f"{md.name} links {target}, which does not exist"


def test_figures_redraw_as_committed(tmp_path):
    """tutorials/figures/draw.py still draws every figure from the engine's state, and the ones a fixed
    state draws alike every time come out as committed: a picture cannot drift from the engine it shows."""
    sys.path.insert(0, str(TUTORIALS / "figures"))
    try:
        from draw import FIGURES
    finally:
        sys.path.remove(str(TUTORIALS / "figures"))
    result = subprocess.run(
        [sys.executable, str(TUTORIALS / "figures" / "draw.py"), "--out", str(tmp_path)],
        cwd=TUTORIALS.parent, capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, f"draw.py failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    stale = []
    for stage, (name, _, same_every_run) in FIGURES.items():
        drawn = (tmp_path / name).read_text(encoding="utf-8")
        assert drawn.startswith("<svg"), f"figure {stage} ({name}) is no SVG"
        if same_every_run and drawn != (TUTORIALS / "figures" / name).read_text(encoding="utf-8"):
            stale.append(name)
    assert not stale, (
        f"the engine now draws {', '.join(stale)} differently from the committed files: redraw them with "
        "`python tutorials/figures/draw.py` and look at them before committing"
    )
