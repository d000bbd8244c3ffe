"""Test-wide settings: the engine's consistency check runs after every step."""

import os

# Before any test module imports torch: the package sets the OpenMP thread policy first.
import pagedkv  # noqa: F401

os.environ.setdefault("PAGEDKV_DEBUG", "1")
