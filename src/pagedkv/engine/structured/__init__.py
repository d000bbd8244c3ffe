"""Structured outputs: constraints (JSON schema, regex, choice, EBNF grammar) compiled by
xgrammar into token masks applied before sampling.

`params` is standard library only (`SamplingParams` carries it); the other modules import
xgrammar and are loaded on the first constrained request.
"""

from pagedkv.engine.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
