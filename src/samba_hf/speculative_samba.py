"""Prompt lookup that stops drafting where its drafts keep being refused.

transformers' prompt lookup drafts whenever the last tokens occurred earlier in the input. Where the model writes
its own text instead of quoting, every such draft is refused, and checking it costs more than the one-token step it
replaces: decoding runs below plain greedy. `PausingPromptLookup` wraps transformers' generator: after a round
whose drafts were all refused, it drafts nothing for the next 1, 2, 4, ... tokens (doubling with each refused round
in a row, at most `max_pause`), and drafts again at once after a round that accepted a drafted token. A round
without a match in the input drafted nothing and changes nothing. The tokens are plain greedy's either way; only
which rounds are checked changes.

Part of the remote code of a saved model: imports only torch and transformers.
"""

import torch
from transformers.generation.candidate_generator import CandidateGenerator


class PausingPromptLookup(CandidateGenerator):
    """transformers' `PromptLookupCandidateGenerator` (`lookup`), paused after refused drafts (module docstring)."""

    def __init__(self, lookup: CandidateGenerator, max_pause: int):
        self.lookup = lookup
        self.max_pause = max_pause
        self.refused_rounds = 0  # rounds in a row whose every drafted token was refused
        self.paused_tokens = 0  # tokens still to decode without drafting
        self.drafted = 0  # tokens drafted for the round being checked

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, torch.Tensor | None]:
        if self.paused_tokens > 0:
            self.paused_tokens -= 1
            self.drafted = 0
            return input_ids, None  # no draft: generate's loop takes one token
        candidates, logits = self.lookup.get_candidates(input_ids, **kwargs)
        self.drafted = candidates.shape[1] - input_ids.shape[1]
        return candidates, logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        self.lookup.update_candidate_strategy(input_ids, scores, num_matches)
        if self.drafted == 0:
            return
        if num_matches > 0:
            self.refused_rounds = 0
        else:
            self.refused_rounds += 1
            self.paused_tokens = min(2 ** (self.refused_rounds - 1), self.max_pause)
