"""kdump's version: its own module so that a writer can name it without importing the package
facade (`kdump/__init__.py`, which loads the public names lazily)."""

__version__ = "0.1.0"
