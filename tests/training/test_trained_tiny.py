"""minfer-tiny, the small trained model minfer ships: found by name offline, writes sentences its grammar
makes, reproduces its model card's perplexity; the perplexity yardstick agrees with transformers; the
training script's loss goes down, reproducibly; the package carries the files."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from minfer.bench.perplexity import perplexity, windows
from minfer.checkpoints.tokenizer_training import train_tokenizer
from minfer.models.loader import BUILTIN_MODELS, resolve_model_dir
from minfer.training.stories import parses, split_sentences, stories
from minfer.training.train_tiny import STORY_CHAT_TEMPLATE, TrainOptions, parse_args, train

ROOT = Path(__file__).resolve().parents[2]
TINY = BUILTIN_MODELS["minfer-tiny"]
DRAFT = BUILTIN_MODELS["minfer-tiny-draft"]
FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
         "README.md", "heldout.txt"]
# Prompts a reader would type: beginnings of stories, some with their first sentence or two written.
PROMPTS = [
    "Once upon a time", "Once upon a time, there was a little girl named", "Once upon a time, in a quiet town,",
    "There was once a brave dog named", "Tom was a happy boy who lived near", "One day, Lily went to",
    "One day, Ben and Mia went to", "One sunny morning, Sam woke up and", "Once upon a time, there was",
    "Once upon a time, there was a shy fox named", "Emma was a funny cat who", "There was once a curious bunny named",
    "Once upon a time, in a busy town, there lived a small bear named", "Ruby was a kind bird who lived near the lake.",
    "There was once a kind girl named Zoe. She liked to", "Ned was a brave boy who lived near the farm. He loved",
    "Once upon a time, there was a little girl named Kate. She had a red",
    "There was once a happy duck named Amy. She loved apples more than anything.",
    "Once upon a time, there was a little boy named Jack. He had a blue kite that he loved very much.",
    "Once upon a time, there was a small frog named Max. His best friend was a",
]


def card_figure(name: str) -> float:
    card = (TINY / "README.md").read_text(encoding="utf-8")
    return float(re.search(rf"\| {name} [^|]*\| [\d.]+ \| ([\d.]+) \|", card).group(1))


def offline_env(tmp_path) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "no-hf-home"), "OMP_NUM_THREADS": "1"}


def test_the_name_resolves_to_the_shipped_files():
    assert resolve_model_dir("minfer-tiny") == TINY
    assert all((TINY / f).is_file() for f in FILES)


def test_generate_works_offline(tmp_path):
    prompt = "Once upon a time"
    done = subprocess.run(
        [sys.executable, "-m", "minfer.generate", "--model", "minfer-tiny", "--temperature", "0",
         "--max-tokens", "80", prompt],
        cwd=tmp_path, env=offline_env(tmp_path), capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    sentences, _ = split_sentences(done.stdout)
    assert done.stdout.startswith(prompt) and len(sentences) >= 3, done.stdout
    assert all(parses(s) for s in sentences), done.stdout


@pytest.fixture(scope="module")
def greedy_outputs():
    from minfer import LLM, SamplingParams

    llm = LLM("minfer-tiny", num_threads=1)  # a model this small runs as fast on one thread
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=200, temperature=0), use_tqdm=False)
    return [p + o.text for p, o in zip(PROMPTS, outs)]


def test_greedy_sentences_parse_under_the_grammar(greedy_outputs):
    """At least 90% of the complete sentences of 20 greedy continuations are sentences the grammar makes."""
    sentences = [s for text in greedy_outputs for s in split_sentences(text)[0]]
    parsed = [s for s in sentences if parses(s)]
    assert len(sentences) >= 100, greedy_outputs
    assert len(parsed) >= 0.9 * len(sentences), [s for s in sentences if not parses(s)]


def test_greedy_stories_end_and_do_not_loop(greedy_outputs):
    """Greedy decoding writes a story to its end (<|endoftext|>), and no sentence comes twice in a row."""
    for text in greedy_outputs:
        sentences, rest = split_sentences(text)
        assert not rest.strip(), text  # finished: the last sentence is whole, then <|endoftext|>
        assert all(a != b for a, b in zip(sentences, sentences[1:])), text


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_a_chat_with_a_shipped_model_gets_a_story_back(name):
    """The shipped models carry the trainer's story chat template: whatever the user writes, the reply
    is a story in sentences the grammar makes, served through the OpenAI chat endpoint."""
    import http.client
    import json

    from minfer.engine.config import EngineConfig
    from serving import serving

    template = json.loads((BUILTIN_MODELS[name] / "tokenizer_config.json").read_text())["chat_template"]
    assert template == STORY_CHAT_TEMPLATE  # what the trainer writes is what ships
    with serving(EngineConfig(model=name, num_kv_blocks=64)) as srv:
        conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=60)
        messages = [{"role": "user", "content": "Tell me a story."}]
        conn.request("POST", "/v1/chat/completions", json.dumps(
            {"model": name, "messages": messages, "max_tokens": 60, "temperature": 0}))
        reply = json.loads(conn.getresponse().read())["choices"][0]["message"]["content"]
    sentences = split_sentences(reply)[0]  # the complete ones: max_tokens may cut the last
    assert reply.startswith("Once upon a time") and len(sentences) >= 2, reply
    assert sum(map(parses, sentences)) >= 0.75 * len(sentences), reply  # the drafts are smaller, and slip


def test_heldout_perplexity_reproduces_the_card(capsys):
    """`minfer eval-ppl` on the shipped held-out split gives the card's figure (within 1%)."""
    import json

    from minfer.bench.perplexity import main

    assert main(["--model", "minfer-tiny", "--num-threads", "1", "--json", str(TINY / "heldout.txt")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["window"], result["stride"], result["dtype"]) == (512, 256, "float32")
    stated = card_figure("held-out perplexity")
    assert abs(result["perplexity"] - stated) <= 0.01 * stated, (result, stated)


@pytest.mark.parametrize("argv, message", [
    (["--stride", "0"], "argument --stride: must be a positive integer, got '0'"),  # was the default, silently
    (["--window", "0"], "argument --window: must be a positive integer, got '0'"),
    (["--num-threads", "0"], "argument --num-threads: must be a positive integer, got '0'"),
    (["--window", "1"], "error: --window must be >= 2 tokens, got 1"),
    (["--window", "8", "--stride", "8"], "error: --stride must be below --window (8): windows overlap, got 8"),
    (["--stride", "600"], "error: --stride must be below --window (512): windows overlap, got 600"),  # the context's
    (["--window", "513"], "error: --window 513 exceeds the model's context of 512"),
    (["--device", "meta"], "error: --device must be cpu, or a CUDA device such as cuda or cuda:0, got 'meta'"),
    (["--device", "xyz"], "error: --device must be cpu, or a CUDA device such as cuda or cuda:0, got 'xyz'"),
    (["--quantization-group-size", "64"], "--quantization-group-size applies to --quantization int4 only"),
    (["--no-quantize-lm-head"], "--no-quantize-lm-head applies with --quantization only (nothing is quantized)"),
])
def test_eval_ppl_refuses_settings_it_would_not_apply(argv, message, capsys):
    from minfer.bench.perplexity import main

    try:
        code = main(["--model", "minfer-tiny", *argv, str(TINY / "heldout.txt")])
    except SystemExit as e:
        code = e.code
    assert code == 2 and message in capsys.readouterr().err  # a bad flag's status, as argparse's


def test_eval_ppl_names_a_file_that_is_not_utf8(tmp_path, capsys):
    from minfer.bench.perplexity import main

    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 au lait".encode("latin-1"))
    assert main(["--model", "minfer-tiny", str(tmp_path / "latin1.txt")]) == 1
    assert capsys.readouterr().err == f"error: {tmp_path / 'latin1.txt'} is not UTF-8 text: byte 0xe9 at offset 3\n"


def test_windows_score_every_token_but_the_first_once():
    for n, window, stride in [(2, 4, 2), (10, 4, 2), (11, 4, 3), (9, 4, 3), (100, 16, 1), (3, 8, 4), (9, 2, 1)]:
        scored = [t for begin, end, first in windows(n, window, stride) for t in range(first, end)]
        assert scored == list(range(1, n)), (n, window, stride)
        assert all(end - begin <= window and begin < first for begin, end, first in windows(n, window, stride))
    with pytest.raises(ValueError, match="stride"):
        list(windows(9, 4, 4))  # no overlap: each window's first token would go unscored


@pytest.mark.parametrize("model", ["random", "minfer-tiny"])
def test_perplexity_agrees_with_transformers(model, make_checkpoint):
    """Same windows, minfer's forward against GPT2LMHeadModel's, fp32: within 1e-4 relative."""
    transformers = pytest.importorskip("transformers")
    from minfer.models.registry import load_model
    from minfer.text.tokenizer import Tokenizer

    path = make_checkpoint("tiny", n_positions=64) if model == "random" else TINY
    ours = load_model(path)
    theirs = transformers.GPT2LMHeadModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    ids = Tokenizer.from_dir(path).encode((TINY / "heldout.txt").read_text(encoding="utf-8")[:3000])
    window = ours.config.max_positions
    mine = perplexity(ours, ids, window, window // 2)
    ref = perplexity(lambda x: theirs(x).logits, ids, window, window // 2)
    assert mine.tokens == ref.tokens == len(ids) - 1
    assert abs(mine.perplexity - ref.perplexity) <= 1e-4 * ref.perplexity, (mine, ref)


SHORT = dict(n_layer=1, n_head=2, n_embd=32, n_positions=64, vocab_size=300, steps=40, batch_size=8, lr=1e-2,
             warmup_steps=5, num_stories=300, tokenizer_stories=300, heldout_stories=5, eval_every=40,
             threads=1)  # one thread: a model this small gains nothing from two, and a busy machine slows them


def test_the_trainer_makes_the_loss_go_down_reproducibly(tmp_path):
    """A shortened run: the loss falls, the checkpoint loads in minfer, and a second run with the same
    seed and threads writes the same bytes."""
    from minfer.models.registry import load_model

    first = train(TrainOptions(**SHORT), tmp_path / "a", log=lambda *a: None)
    losses = first["losses"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0, losses
    assert first["heldout_loss"] < losses[0]
    load_model(tmp_path / "a")
    again = train(TrainOptions(**SHORT), tmp_path / "b", log=lambda *a: None)
    assert again["losses"] == losses
    for name in ("model.safetensors", "tokenizer.json", "heldout.txt"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_init_goes_on_from_a_trained_model(tmp_path):
    """`--init DIR` starts from DIR's weights and tokenizer: its first loss is far below a fresh start's."""
    from dataclasses import replace

    first = train(TrainOptions(**SHORT), tmp_path / "a", log=lambda *a: None)
    more = train(replace(TrainOptions(**SHORT), init=str(tmp_path / "a"), steps=5), tmp_path / "b", log=lambda *a: None)
    assert more["losses"][0] < first["losses"][0] - 1.0, (more["losses"], first["losses"])
    assert (tmp_path / "b" / "tokenizer.json").read_bytes() == (tmp_path / "a" / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("argv, message", [
    (["OUT", "--steps", "-1"], "--steps must be >= 0, got -1"),
    (["OUT", "--n-layer", "0"], "--n-layer must be >= 1, got 0"),
    (["OUT", "--lr", "-0.1"], "--lr must be >= 0, got -0.1"),
    (["OUT", "--retell", "1.5"], "--retell must be a chance in [0, 1], got 1.5"),
    ([""], "the output directory is empty: name the directory to write"),
    (["FILE"], "a-file exists and is not a directory"),
    (["SOMEONES"], "someones is not empty and holds no trained model of minfer's: pass --force to write into it anyway"),
])
def test_the_trainer_refuses_what_trains_nothing_before_it_trains(argv, message, capsys, tmp_path):
    (tmp_path / "a-file").write_text("")
    (tmp_path / "someones").mkdir()
    (tmp_path / "someones" / "model.safetensors").write_text("")  # a model of another's: refused without --force
    paths = {"OUT": str(tmp_path / "new"), "FILE": str(tmp_path / "a-file"), "SOMEONES": str(tmp_path / "someones")}
    with pytest.raises(SystemExit) as e:
        parse_args([paths.get(a, a) for a in argv], "train_tiny")
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_trainer_writes_again_where_it_wrote_and_with_force_anywhere(tmp_path):
    assert parse_args([str(BUILTIN_MODELS["minfer-tiny"])], "t")[0] == BUILTIN_MODELS["minfer-tiny"]  # the card's command
    (tmp_path / "notes.txt").write_text("")
    assert parse_args([str(tmp_path), "--force"], "t")[0] == tmp_path


def test_an_out_dir_that_cannot_be_made_is_one_line_before_the_training(capsys):
    from minfer.training.train_tiny import main

    assert main(["/proc/no-such-dir", "--steps", "0"], "train_tiny") == 1
    assert capsys.readouterr().err == "train_tiny: error: cannot write /proc/no-such-dir: No such file or directory\n"


def test_the_card_states_the_defaults_and_the_shipped_shape():
    """The card's reproduce commands are the trainer's defaults (what the shipped config.json holds): one
    from scratch, or one that goes on (`--init`) from a model the command before it trains (with the
    defaults, except the retellings: the earlier model had none)."""
    import json
    from dataclasses import replace

    card = (TINY / "README.md").read_text(encoding="utf-8")
    lines = re.search(r"## Reproducing it\n\n```bash\n(.+?)\n```", card, re.DOTALL).group(1).splitlines()
    assert all(line.split()[:2] == ["python", "scripts/train_tiny.py"] for line in lines)
    (out, opts, _), *before = [parse_args(line.split()[2:], "train_tiny") for line in reversed(lines)]
    assert out == Path("minfer/models/builtin/minfer-tiny")
    if opts.init:  # went on from a trained model: the command before trains it
        base_out, base_opts, _ = before[0]
        assert base_out == Path(opts.init) and base_opts == replace(TrainOptions(), retell=0.0)
        assert opts.retell == TrainOptions().retell
    else:  # from scratch: the defaults, the retellings aside (the shipped model predates them: --retell 0)
        assert opts == replace(TrainOptions(), retell=opts.retell) and opts.retell in (0.0, TrainOptions().retell)
    config = json.loads((TINY / "config.json").read_text())
    shape = {k: config[k] for k in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size")}
    assert shape == {k: getattr(opts, k) for k in shape}


def test_the_tokenizer_trains_on_a_corpus_deterministically():
    texts = stories(1, 300)
    a, b = train_tokenizer(500, corpus=texts), train_tokenizer(500, corpus=texts)
    assert a.get_vocab() == b.get_vocab() and a.get_vocab_size() == 500
    assert len(a.encode(texts[0]).ids) < len(texts[0]) / 2  # it learned the corpus's words
    with pytest.raises(ValueError, match="too large"):
        train_tokenizer(5000, corpus=texts[:3])


def test_the_grammar_parses_its_own_stories_and_not_others():
    for text in stories(7, 200):
        sentences, rest = split_sentences(text)
        assert sentences and not rest.strip() and all(parses(s) for s in sentences), text
    assert not parses("Once upon a time, there was a little girl named Zebra.")
    assert not parses("The cat sat on the mat.")
    assert split_sentences('Tom said, "Hi, Sue!" She smiled. And') == (['Tom said, "Hi, Sue!"', "She smiled."], " And")


def test_the_package_carries_the_model():
    from importlib.resources import files

    for name in BUILTIN_MODELS:
        shipped = files("minfer.models") / "builtin" / name
        assert all((shipped / f).is_file() for f in FILES), name
        assert f'"builtin/{name}/*"' in (ROOT / "pyproject.toml").read_text(), name
    # The trained-model issue's budget: the package grows by at most 8 MB with every shipped model.
    assert sum(p.stat().st_size for path in BUILTIN_MODELS.values() for p in path.iterdir()) <= 8 * 1024 * 1024


def test_a_wheel_carries_the_model(tmp_path):
    """`pip wheel . --no-deps` puts every file in the wheel (built with the setuptools installed here, if
    any: quicker, and no index needed)."""
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode:
        pytest.skip("pip is not available to this Python")
    source = tmp_path / "src"  # a copy, so the build leaves nothing behind in the checkout
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "*.egg-info", "build", "dist", "__pycache__",
                                                                 ".pytest_cache"))
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", *isolation, "-w", str(tmp_path / "w")],
        cwd=source, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (tmp_path / "w").glob("minfer-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"minfer/models/builtin/{m}/{f}" for m in BUILTIN_MODELS for f in FILES} <= names
