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

import torch
import xgrammar as xgr

from pagedkv.engine.request import SeqId


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


class BeamMatchers:
    """The matchers of a beam search's live beams, by sequence id.

    A surviving candidate forks its parent's matcher and feeds it the candidate's token, so
    siblings never replay their common output.
    """

    def __init__(self, grammar: xgr.CompiledGrammar) -> None:
        self.grammar = grammar
        self._matchers: dict[SeqId, xgr.GrammarMatcher] = {}

    def start(self, seq_id: SeqId) -> None:
        """A first beam, with no output yet."""
        self._matchers[seq_id] = xgr.GrammarMatcher(self.grammar)

    def fork(self, parent: SeqId, child: SeqId, token_id: int) -> None:
        """`child` continues `parent` with `token_id` (a token its grammar allowed)."""
        matcher = self._matchers[parent].fork()
        if not matcher.accept_token(token_id):
            raise ValueError(f"beam {child}: token {token_id} is refused by its grammar")
        self._matchers[child] = matcher

    def drop(self, seq_id: SeqId) -> None:
        self._matchers.pop(seq_id, None)

    def fill(self, seq_ids: Sequence[SeqId], vocab_size: int) -> torch.Tensor:
        """The bitmask [len(seq_ids), ceil(vocab_size / 32)] int32, row k for seq_ids[k]
        (a sequence without a matcher allows every token)."""
        bitmask = xgr.allocate_token_bitmask(len(seq_ids), vocab_size)
        for k, seq_id in enumerate(seq_ids):
            matcher = self._matchers.get(seq_id)
            if matcher is not None:
                matcher.fill_next_token_bitmask(bitmask, k)
        return bitmask
