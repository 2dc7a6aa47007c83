"""The dflash drafter kind: importing the package registers it (drafters/registry.py)."""

from drafter_train.drafters.dflash import model  # noqa: F401  (registers the kind)
