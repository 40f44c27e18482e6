"""The package version, read by setup (pyproject dynamic version) and build_info()."""
__version__ = "0.1.0"
