"""Errors that reach the user as one clear line (entry points print them without a traceback)."""


class DrafterTrainError(Exception):
    """Base class: anything the user can fix from the message alone."""


class ConfigError(DrafterTrainError, ValueError):
    """An impossible config value; the message starts with the field name."""


class VocabMismatchError(DrafterTrainError, ValueError):
    """Drafter and target do not share a vocabulary, so draft tokens would mean different things."""


class ModelNotFoundError(DrafterTrainError, FileNotFoundError):
    """A target or drafter path that is neither a local folder/file nor loadable from the hub."""


class CheckpointDamagedError(DrafterTrainError):
    """A checkpoint's files are missing or differ from the checksums recorded when it was written."""
