"""Shared test utilities: tiny random HF models and a trained BPE tokenizer.

Import as `from helpers import make_hf_model, make_tokenizer` (tests/ is on sys.path through
tests/conftest.py) or `from tests.helpers import ...` when the repo root is on sys.path.
"""

from .chat_tokenizers import make_chat_tokenizer
from .hf_models import ARCHS, hf_config, make_hf_model
from .tokenizer import CHAT_TEMPLATE, make_tokenizer

__all__ = [
    "ARCHS",
    "CHAT_TEMPLATE",
    "hf_config",
    "make_chat_tokenizer",
    "make_hf_model",
    "make_tokenizer",
]
