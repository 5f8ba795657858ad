"""The package version (its one home: `gs.__version__` and checkpoints read it)."""

__version__ = "0.1.0"
