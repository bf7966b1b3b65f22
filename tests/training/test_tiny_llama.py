"""minfer-tiny-llama and its draft: the Llama-shaped trained models minfer ships for speculative decoding.
Found by name, minfer-tiny's tokenizer and held-out text byte for byte, trained by the card's command, the
card's figures reproduce, transformers agrees, and the target really copies from its context (what
minfer-tiny does not learn, and what n-gram speculation needs). Also the trainer's Llama shape and its
copy warm-up on a shortened run."""

import re
from pathlib import Path

import pytest
import torch
from model_cards import card_copy_figures
from tokenizers import Tokenizer

from minfer.models.llama import Llama
from minfer.models.loader import BUILTIN_MODELS, resolve_model_dir
from minfer.models.registry import load_model
from minfer.training.copy_warmup import MAX_RUN, copy_warmup, drill_batch, losses_if
from minfer.training.copying import copy_accuracy
from minfer.training.stories import stories
from minfer.training.train_tiny import TrainOptions, make_optimizer, parse_args, train

TINY = BUILTIN_MODELS["minfer-tiny"]
LLAMA, DRAFT = BUILTIN_MODELS["minfer-tiny-llama"], BUILTIN_MODELS["minfer-tiny-llama-draft"]


def card(path: Path) -> str:
    return (path / "README.md").read_text(encoding="utf-8")


def card_command(path: Path):
    command = re.search(r"## Reproducing it\n\n```bash\n(.+)\n```", card(path)).group(1).split()
    assert command[:2] == ["python", "scripts/train_tiny.py"]
    return parse_args(command[2:], "train_tiny")


def num_params(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@pytest.mark.parametrize("path", [LLAMA, DRAFT], ids=["target", "draft"])
def test_found_by_name_with_minfer_tinys_tokenizer_and_text(path):
    assert resolve_model_dir(path.name) == path
    assert (path / "tokenizer.json").read_bytes() == (TINY / "tokenizer.json").read_bytes()
    assert (path / "heldout.txt").read_bytes() == (TINY / "heldout.txt").read_bytes()
    assert isinstance(load_model(path), Llama)


def test_the_cards_commands_train_these_shapes():
    """Both were trained with the Llama shape and the copy warm-up on minfer-tiny's text; the target
    with the default shape (minfer-tiny's), the draft with half its layers."""
    import json

    (out, opts, _), (draft_out, draft_opts, _) = card_command(LLAMA), card_command(DRAFT)
    assert out == Path("minfer/models/builtin/minfer-tiny-llama")
    assert draft_out == Path("minfer/models/builtin/minfer-tiny-llama-draft")
    assert opts.arch == draft_opts.arch == "llama" and opts.copy_warmup_steps and draft_opts.copy_warmup_steps
    same = {"seed", "num_stories", "retell", "n_positions", "vocab_size"}  # the same training text
    assert {k: getattr(draft_opts, k) for k in same} == {k: getattr(opts, k) for k in same}
    assert {k: getattr(opts, k) for k in ("n_layer", "n_head", "n_embd")} == {"n_layer": 4, "n_head": 4, "n_embd": 128}
    config = json.loads((LLAMA / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["max_position_embeddings"]) == (
        opts.n_layer, opts.n_embd, opts.n_positions)
    # Half the layers: at this size a forward costs mostly per-layer overhead, not width (docs/speculative.md).
    draft, target = load_model(DRAFT), load_model(LLAMA)
    assert 2 * draft.config.num_layers <= target.config.num_layers and num_params(draft) < num_params(target)


@pytest.mark.parametrize("path", [LLAMA, DRAFT], ids=["target", "draft"])
def test_the_card_figures_reproduce(path, capsys):
    """`minfer eval-ppl` on heldout.txt gives the card's perplexity (within 1%); the copy figures reproduce."""
    import json

    from minfer.bench.perplexity import main

    assert main(["--model", path.name, "--num-threads", "1", "--json", str(path / "heldout.txt")]) == 0
    result = json.loads(capsys.readouterr().out)
    stated = float(re.search(r"\| held-out perplexity [^|]*\| [\d.]+ \| ([\d.]+) \|", card(path)).group(1))
    assert abs(result["perplexity"] - stated) <= 0.01 * stated, (result, stated)
    forced, greedy = card_copy_figures(path)
    torch.set_num_threads(1)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    score = copy_accuracy(load_model(path), tokenizer, stories("heldout-0", 200))
    assert abs(score.teacher_forced - forced) < 0.002, (score, forced)
    assert abs(score.greedy - greedy) < 0.002, (score, greedy)


def test_the_target_copies_where_minfer_tiny_does_not():
    """On bench's copy prompt, minfer-tiny-llama writes back most of a story it read; minfer-tiny, the
    same text and size with learned positions, barely starts."""
    torch.set_num_threads(1)
    tokenizer, texts = Tokenizer.from_file(str(TINY / "tokenizer.json")), stories("heldout-0", 200)
    llama = copy_accuracy(load_model(LLAMA), tokenizer, texts, num=8)
    gpt2 = copy_accuracy(load_model(TINY), tokenizer, texts, num=8)
    assert llama.greedy > 0.5 and llama.teacher_forced > 0.95, llama
    assert gpt2.greedy < 0.2, gpt2


def test_the_greedy_share_is_what_greedy_decoding_writes():
    """copy_accuracy reads greedy decoding's run off the teacher-forced argmaxes: the same count as decoding
    token by token, each step fed its own output, up to the first token that differs."""
    from minfer.bench.workload import EOS, copy_prompt

    torch.set_num_threads(1)
    model, tokenizer = load_model(LLAMA), Tokenizer.from_file(str(LLAMA / "tokenizer.json"))
    texts = stories("heldout-0", 200)[:6]  # three prompts, all within the context
    written = total = 0
    with torch.inference_mode():
        for first, second in zip(texts[0::2], texts[1::2]):
            ids = tokenizer.encode(copy_prompt(first, second)).ids
            target = tokenizer.encode(f"{first}{EOS}{second}{EOS}{first}{EOS}").ids[len(ids) :]
            for want in target:
                if int(model(torch.tensor([ids]))[0, -1].argmax()) != want:
                    break
                ids.append(want)
                written += 1
            total += len(target)
    assert 0 < written < total
    assert copy_accuracy(model, tokenizer, texts, num=3).greedy == written / total


def test_transformers_agrees_on_the_llama_shape():
    """LlamaForCausalLM on the same files, fp32: the same perplexity within 1e-4 relative."""
    transformers = pytest.importorskip("transformers")
    from minfer.bench.perplexity import perplexity
    from minfer.text.tokenizer import Tokenizer as MinferTokenizer

    ours = load_model(LLAMA)
    theirs = transformers.LlamaForCausalLM.from_pretrained(LLAMA, torch_dtype=torch.float32).eval()
    ids = MinferTokenizer.from_dir(LLAMA).encode((LLAMA / "heldout.txt").read_text(encoding="utf-8")[:3000])
    mine = perplexity(ours, ids, 512, 256)
    ref = perplexity(lambda x: theirs(x).logits, ids, 512, 256)
    assert abs(mine.perplexity - ref.perplexity) <= 1e-4 * ref.perplexity, (mine, ref)


# ---- the trainer's Llama shape and the copy warm-up ------------------------------------------------

SHORT = dict(arch="llama", n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=300, steps=20, batch_size=8,
             lr=1e-2, warmup_steps=5, num_stories=300, tokenizer_stories=300, heldout_stories=5, eval_every=20,
             threads=1, copy_warmup_steps=20)


def test_the_llama_trainer_learns_reproducibly_and_writes_a_loadable_checkpoint(tmp_path):
    """A shortened Llama run with the copy warm-up: the loss falls, minfer and transformers load the
    result, and a second run writes the same bytes."""
    first = train(TrainOptions(**SHORT), tmp_path / "a", log=lambda *a: None)
    losses = first["losses"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
    assert first["copy_warmup"]["steps"] == 20
    model = load_model(tmp_path / "a")
    assert isinstance(model, Llama) and model.config.intermediate_size == 96  # 8/3 of 32, rounded up to 32
    again = train(TrainOptions(**SHORT), tmp_path / "b", log=lambda *a: None)
    assert again["losses"] == losses
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a", torch_dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 42, 7, 99, 3]])
    torch.testing.assert_close(theirs(ids).logits, model(ids), rtol=1e-4, atol=1e-4)


def test_drill_rows_tell_a_run_twice():
    generator = torch.Generator().manual_seed(3)
    inputs, targets = drill_batch(generator, vocab_size=50, eos_id=20)
    assert inputs.shape == targets.shape == (32, 2 * MAX_RUN)
    for row, target in zip(inputs.tolist(), targets.tolist()):
        n = (row + [20]).index(20) // 2  # the run's length: <|endoftext|> (or the row's end) ends the retelling
        assert 8 <= n <= MAX_RUN and row[:n] == row[n : 2 * n] and 20 not in row[: 2 * n]
        assert target[: 2 * n - 1] == row[1 : 2 * n] and set(target[2 * n - 1 :]) <= {-1}
    guess, copying = losses_if(50)
    assert guess == pytest.approx(torch.log(torch.tensor(49.0)).item()) and copying < guess / 1.9


def test_the_warm_up_switches_the_mlps_off_only_while_it_drills():
    """During the drill every block's MLP output is replaced by zeros, so only attention learns (the MLP
    weights get no gradient and stay as they were); afterwards no hook is left and the MLPs count again."""
    from minfer.training.tiny_shapes import build_model, init_weights, tiny_config

    torch.manual_seed(0)
    model = build_model(tiny_config("llama", 60, 59, 64, 32, 2, 2))
    init_weights(model, 2)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    copy_warmup(model, make_optimizer(model, TrainOptions()), 3, 1e-3, 0, 60, 59, log=lambda *a: None)
    after = dict(model.named_parameters())
    mlp = [name for name in before if ".mlp." in name]
    assert len(mlp) == 6 and all(torch.equal(before[name], after[name]) for name in mlp)
    assert not torch.equal(before["layers.1.self_attn.q_proj.weight"], after["layers.1.self_attn.q_proj.weight"])
    assert all(not block.mlp._forward_hooks for block in model.layers)
    ids = torch.tensor([[1, 2, 3]])
    with_mlps = model(ids)
    for block in model.layers:
        torch.nn.init.zeros_(block.mlp.down_proj.weight)
    assert not torch.allclose(model(ids), with_mlps)  # the MLPs shape the output again
