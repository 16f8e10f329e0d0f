"""pagoda's version, written once: the package metadata (pyproject.toml) and `/version` both read it here."""

__version__ = "0.1.0"
