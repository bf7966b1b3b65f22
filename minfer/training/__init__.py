"""Training minfer's tiny models: the story grammar, the trainer, the copy warm-up, the copy score and the
model card (`minfer train-tiny`, `python scripts/train_tiny.py`).

A room apart from the inference layers: it imports what it needs of them (the models it trains, the
checkpoint writers' files and tokenizer trainer, the perplexity yardstick), and nothing in minfer imports
it but the `minfer` command.
"""
