"""What a generation returns: the emitted ids and text, and its statistics (single and batched paths)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0  # verification forwards (prefill not counted)
    accepted_per_depth: list[int] = field(default_factory=list)  # how often depth d+1 was accepted
    tree_nodes: int = 0  # nodes the verification forwards scored (roots included)
    projected_rows: int = 0  # of them, those the target's lm_head projected (fewer with on-demand rows)
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_bookkeeping: float = 0.0
    time_total: float = 0.0
    stopped_by: str = ""

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target forward (bonus included); the first token comes from prefill."""
        return (self.new_tokens - 1) / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.time_total if self.time_total else 0.0

    def summary(self) -> str:
        other = self.time_total - self.time_prefill - self.time_draft - self.time_verify
        rows = f"; lm_head over {self.projected_rows} of {self.tree_nodes} tree nodes" \
            if self.projected_rows < self.tree_nodes else ""
        return (f"{self.new_tokens} tokens in {self.time_total:.2f}s ({self.tokens_per_s:.1f} tok/s), "
                f"tau {self.tau:.2f} over {self.target_forwards} target forwards; time: draft "
                f"{self.time_draft:.2f}s, verify {self.time_verify:.2f}s, other {other:.2f}s{rows}")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tau": self.tau, "tokens_per_s": self.tokens_per_s}

    def record_accepted(self, accepted: int) -> None:
        """A step accepted drafts at depths 1..``accepted``."""
        self.accepted_per_depth += [0] * (accepted - len(self.accepted_per_depth))
        for d in range(accepted):
            self.accepted_per_depth[d] += 1


@dataclass
class GenerationOutput:
    ids: list[int]  # new tokens only
    text: str
    stats: GenerationStats


@dataclass
class BatchOutput:
    """One ``GenerationOutput`` per prompt (in order; each with its own stats), plus the batch's totals."""

    rows: list[GenerationOutput]
    target_forwards: int = 0  # batched verification forwards (prefill not counted)
    time_total: float = 0.0

    @property
    def new_tokens(self) -> int:
        return sum(len(r.ids) for r in self.rows)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.time_total if self.time_total else 0.0

