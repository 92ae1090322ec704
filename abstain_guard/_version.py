"""The package version (one home; the artifact manifest records it)."""

__version__ = "0.1.0"
