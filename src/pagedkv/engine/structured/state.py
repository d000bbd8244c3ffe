"""A request's grammar state: its compiled grammar and one matcher per sequence.

The state lives on the request (`Request.grammar`), beside the sequences it follows. A
matcher is keyed by sample index and synced to its sequence's output tokens before each
use: it accepts the tokens it has not seen. A sequence whose tokens no longer extend what
its matcher accepted (a beam that took another's place) gets a fresh matcher that replays
its output. So a fork (n > 1) needs nothing from the scheduler: the new sample's matcher
replays the tokens it was forked with; a preempted sequence keeps its output tokens through
recompute or swap, and its matcher stays valid as it is.
"""

from __future__ import annotations

from collections.abc import Sequence

import xgrammar as xgr


class GrammarState:
    """The grammar of one request and a matcher per sample index."""

    def __init__(self, grammar: xgr.CompiledGrammar) -> None:
        self.grammar = grammar
        # sample index -> (matcher, the output tokens it accepted)
        self._matchers: dict[int, tuple[xgr.GrammarMatcher, list[int]]] = {}
        # Sample indices that took a token their grammar refused: the engine ends them.
        self.refused: set[int] = set()

    def matcher(self, index: int, output_token_ids: Sequence[int]) -> xgr.GrammarMatcher:
        """Sample `index`'s matcher, advanced over `output_token_ids` (that sample's
        generated tokens so far). A token the grammar refuses is recorded in `refused`
        and the matcher stays where it was."""
        entry = self._matchers.get(index)
        if entry is None or not _extends(output_token_ids, entry[1]):
            entry = self._matchers[index] = (xgr.GrammarMatcher(self.grammar), [])
            self.refused.discard(index)
        matcher, accepted = entry
        if index not in self.refused:
            for token in output_token_ids[len(accepted) :]:
                if not matcher.accept_token(token):
                    self.refused.add(index)
                    break
                accepted.append(token)
        return matcher


def _extends(tokens: Sequence[int], accepted: list[int]) -> bool:
    """Whether `tokens` continue `accepted` (checked at its last token: sequences only grow
    by appending, so a replaced sequence shows at that position or in its length)."""
    n = len(accepted)
    return n <= len(tokens) and (n == 0 or tokens[n - 1] == accepted[-1])
