"""The package's version (read by the calibration caches' keys as well as by users)."""

__version__ = "0.1.0"
