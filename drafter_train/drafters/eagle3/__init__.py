"""The eagle3 drafter kind: importing the package registers it (drafters/registry.py)."""

from drafter_train.drafters.eagle3 import model  # noqa: F401  (registers the kind)
