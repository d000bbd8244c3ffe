"""Test-wide settings: the engine's consistency check runs after every step."""

import os

os.environ.setdefault("PAGEDKV_DEBUG", "1")
