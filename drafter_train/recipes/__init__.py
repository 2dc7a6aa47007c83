"""The entry points (console scripts) and only they: nothing else in the package imports this package."""
