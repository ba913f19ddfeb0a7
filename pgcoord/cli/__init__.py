"""The ``pgcoord`` command: migrate, status, jobs, doctor, demo."""

from .main import main

__all__ = ["main"]
