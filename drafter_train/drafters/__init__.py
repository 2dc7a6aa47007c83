"""Drafter kinds, one folder each; drafters/registry.py finds them."""
