"""The package's version (pyproject.toml's; a test checks that they agree)."""

__version__ = "0.1.0"
