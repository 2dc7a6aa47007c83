"""Whether a speculative decoder's output differs from plain decoding only at the engine's near-tie numerics.

Greedy speculative decoding is lossless in exact arithmetic. In an engine, a verify step evaluates several tokens in
one batch, and a batch can round differently from a 1-token step, so where the top two tokens nearly tie, either can
come out. A difference is shown to be that, not a drafter's doing, from the plain decoder's own log-probabilities,
replayed on the plain server (llamacpp_server.near_tie_logprobs): 1 token a step, in one multi-token pass, and in a
verify step's shape. The served table checks every row's differences this way (table.check_near_ties); drafter-eval
in llama.cpp checks its own (`same_output_as_plain`).
"""

from __future__ import annotations

from pathlib import Path
from statistics import median
from typing import Optional

from drafter_train.engines.base import output_mismatches

NEAR_TIE_PROBS = 10  # top log-probabilities asked for at a difference: the other decoder's token must be among them


def near_tie(case: dict) -> dict:
    """Whether a difference is the engine's near-tie numerics, from the plain decoder's own log-probabilities
    (near_tie_logprobs): plain wrote token a at the position, the other decoder b. The margin a - b (a difference of
    log-probabilities) as plain computes it, 1 token a step; as one multi-token pass over the same prefix computes it; and
    as a verify step's batch of the prefix's last m tokens does (`margin_verify`, per batch size). Shown a near tie
    when the replay reproduced plain's output and the margin is no larger than the shift one of the engine's own
    batch shapes gives it: then arithmetic alone, not the drafter, can pick either token. `flips_in`: the batch
    sizes whose arithmetic itself picks b (the other decoder's token)."""
    k, reference, other = case["position"], case["reference"], case["other"]
    a = reference[k] if k < len(reference) else None
    b = other[k] if k < len(other) else None
    step = case["stepwise"][k] if k < len(case["stepwise"]) else {}

    def margin(logprobs: dict) -> Optional[float]:
        return logprobs[a] - logprobs[b] if a in logprobs and b in logprobs else None

    stepwise, batched = margin(step), margin(case["batched"])
    verify = [{"batch": v["batch"], "margin": margin(v["logprobs"])} for v in case.get("verify", ())]
    shifts = [abs(stepwise - m) for m in [batched, *(v["margin"] for v in verify)]
              if stepwise is not None and m is not None]
    reproduced = case["stepwise_tokens"][:k + 1] == reference[:k + 1]
    tops = [sorted(lp.values(), reverse=True) for lp in case["stepwise"][:k]]
    typical = [t[0] - t[1] for t in tops if len(t) > 1]
    return {"round": case["round"], "prompt": case["prompt_index"], "position": k, "plain_token": a,
            "other_token": b, "reproduced": reproduced, "margin_stepwise": stepwise, "margin_batched": batched,
            "margin_verify": verify, "flips_in": [v["batch"] for v in verify if v["margin"] is not None
                                                  and v["margin"] < 0],
            "other_rank": sorted(step, key=step.get, reverse=True).index(b) + 1 if b in step else None,
            "median_margin_before": median(typical) if typical else None,
            "near_tie": bool(reproduced and stepwise is not None and batched is not None and shifts
                             and stepwise <= max(shifts))}


def same_output_as_plain(plain: list[list[int]], spec: list[list[int]], prompts: list[list[int]], draft_len: int,
                         plain_command: Optional[list[str]], log: Path, n_probs: int = NEAR_TIE_PROBS) -> dict:
    """One decode's speculative output against its plain output, prompt by prompt: how many are identical, the
    differences (output_mismatches), and, given the plain server's command (llama.cpp), each difference replayed on
    it (near_tie: at the first differing position, with verify batches of 2..draft_len + 1 tokens) and how many
    were shown to be near ties."""
    differences = output_mismatches(spec, plain)
    out = {"prompts": len(plain), "identical": len(plain) - len(differences), "differences": differences}
    if not differences or plain_command is None:
        return out
    from drafter_train.engines.llamacpp_server import near_tie_logprobs

    cases = [{"row": 0, "round": 0, "prompt_index": d["prompt"], "position": d["first_difference"],
              "prompt": prompts[d["prompt"]], "reference": plain[d["prompt"]], "other": spec[d["prompt"]],
              "verify_sizes": list(range(2, draft_len + 2))} for d in differences]
    out["near_ties"] = [near_tie(case) for case in near_tie_logprobs(plain_command, log, cases, n_probs)]
    out["near_ties_shown"] = sum(t["near_tie"] for t in out["near_ties"])
    return out
