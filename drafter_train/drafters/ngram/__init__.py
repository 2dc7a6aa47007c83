"""The ngram drafter kind: importing the package registers it (drafters/registry.py)."""

from drafter_train.drafters.ngram import model  # noqa: F401  (registers the kind)
