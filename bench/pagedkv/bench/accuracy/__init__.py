"""Accuracy of a lossy KV cache, measured on a model that has learned
something: the corpus (corpus.py) and the recipe that trains it (train.py)."""
