"""A small local lm-evaluation-harness task set (no Hub): JSONL data and task YAMLs written to a folder.

Three tasks cover the three request kinds an eval harness sends:
- minfer_mc: multiple choice (loglikelihood of each choice after the question, and is_greedy);
- minfer_ppl: rolling perplexity over texts longer than the window (loglikelihood_rolling);
- minfer_gen: greedy generation until a newline (generate_until).
"""

import json
from pathlib import Path

# minfer-tiny's grammar (stories.py): its likeliest choice is often the right one, so is_greedy is exercised.
QUESTIONS = [
    ("Once upon a time, there was a happy bunny named Jane. Her best", ["friend", "apple", "the"], 0),
    ("One day, Jane and Ruby went to the woods to", ["play", "sleep", "fence"], 0),
    ('Jane said, "I want to share the', ['key!"', "mouse.", "woods"], 0),
    ("Jane learned that it is good to be kind. The", ["end.", "bunny", "key"], 0),
    ("There was once a happy bear named Leo. He liked to play outside every", ["day.", "bear", "night"], 0),
    ("Tim and Bob played with the toy car all", ["day.", "night.", "apples"], 0),
]
TEXTS = [
    (
        "Once upon a time, there was a little mouse named Tim. He loved apples more than anything. One day, Tim and "
        "Bob went to the park to play. At the park, he found a big toy car near a bush. Then a cat came and took the "
        'toy car away. Tim said, "I want to keep the toy car!" His mom smiled and said, "Do not worry, I will help '
        'you." Tim and Bob played with the toy car all day. Tim learned that asking for help is good.'
    ),
    (
        "There was once a happy bear named Leo. He liked to play outside every day. One sunny morning, Leo woke up "
        "and went to the lake. He heard a soft cry behind a bush and found a old book there."
    ),
    "Sara learned that friends make everything better. The end.",
]
PROMPTS = [
    "Once upon a time, there was a",
    "One day, Sara and Amy went to the",
    'Jane said, "I want to',
    "There was once a happy bear named",
]

MC = """task: minfer_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
PPL = """task: minfer_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
"""
GEN = """task: minfer_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: " the end"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
TASKS = ["minfer_mc", "minfer_ppl", "minfer_gen"]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_tasks(folder: Path) -> Path:
    """Write the data and the three task YAMLs into `folder`; returns it, for TaskManager(include_path=...)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    mc = _jsonl(folder / "mc.jsonl", [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS])
    ppl = _jsonl(folder / "ppl.jsonl", [{"text": t} for t in TEXTS])
    gen = _jsonl(folder / "gen.jsonl", [{"prompt": p} for p in PROMPTS])
    (folder / "minfer_mc.yaml").write_text(MC.format(data=mc))
    (folder / "minfer_ppl.yaml").write_text(PPL.format(data=ppl))
    (folder / "minfer_gen.yaml").write_text(GEN.format(data=gen))
    return folder
