"""drafter_train: train drafter models for speculative decoding and measure them with a lossless decoder."""

__version__ = "0.1.0"
