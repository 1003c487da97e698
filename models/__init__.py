"""Models built on moetrain (each a sub-package with its config, data, training and generation)."""
