"""The package version, in one place: the command line, exports and provenance read it here."""

__version__ = "0.1.0"
