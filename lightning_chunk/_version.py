"""The package's version, in a module of its own so that the modules the package imports can read it."""

__version__ = "0.1.0"
