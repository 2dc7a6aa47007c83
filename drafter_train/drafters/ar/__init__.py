"""The ar drafter kind: model.py registers it, config.py holds its typed config (drafters/registry.py imports
each when needed)."""
