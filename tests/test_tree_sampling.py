"""Tree verification with sampling is lossless: the decoder's samples follow the target's own distribution.

Each rule (recursive rejection over deterministic top-k siblings, SpecInfer's rule over i.i.d. sampled siblings,
SpecTr's K-SEQ) is checked with the chi-square machinery of test_sampling_exactness.py against exact marginals, and
each has a negative twin: the same rule with a deliberately broken residual must fail the same check.
"""

from __future__ import annotations

import pytest
import torch

from drafter_train.decoding import verify
from drafter_train.decoding.drafter import ARDrafter
from drafter_train.decoding.sampling import SamplingParams
from drafter_train.decoding.speculative import generate_tree_speculative
from drafter_train.decoding.tree import TreeSpec
from drafter_train.decoding.verify import kseq_rho, make_tree_verifier
from drafter_train.drafters.eagle3.model import Eagle3Drafter
from tests.conftest import tiny_llama
from tests.stubs import BigramLM
from tests.test_eagle3 import random_eagle3
from tests.test_sampling_exactness import bigram_marginals, chi2_pvalue, enumerate_marginals, make_bigram_pair

CASES = {  # rule -> (verify mode, tree)
    "topk-onehot": ("sample", TreeSpec(2, 2, 4)),
    "iid-specinfer": ("sample", TreeSpec(3, 2, None, "iid")),
    "iid-spectr": ("spectr", TreeSpec(3, 2, None, "iid")),
}
T1, T07 = SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4, top_p=0.9)


def forget_rejected(p, q):
    """Bug: the residual does not remove the draft mass (after rejections the target's p is sampled as it was)."""
    return p


def tree_counts(target, make_drafter, prompt, vocab, mode, spec, params, runs, num_tokens):
    counts = torch.zeros(num_tokens, vocab)
    generator = torch.Generator().manual_seed(1234)
    verifier = make_tree_verifier(mode, params)
    for _ in range(runs):
        out = generate_tree_speculative(target, make_drafter(), prompt, spec, verifier, num_tokens, params,
                                        generator=generator)
        counts[torch.arange(num_tokens), torch.tensor(out.tokens)] += 1
    return counts


def bigram_pvalues(mode, spec, params, runs=1500, num_tokens=4):
    target_table, draft_table = make_bigram_pair()
    draft = BigramLM(draft_table)  # once: its LlamaConfig cost a fifth of each run; the ARDrafter is new each run
    counts = tree_counts(BigramLM(target_table), lambda: ARDrafter(draft), [0], 6, mode, spec, params, runs,
                         num_tokens)
    exact = bigram_marginals(target_table, 0, params, num_tokens)
    return [chi2_pvalue(counts[j], exact[j]) for j in range(num_tokens)]


@pytest.mark.parametrize("case,params", [("topk-onehot", T1), ("topk-onehot", T07), ("iid-specinfer", T1),
                                         ("iid-spectr", T07)],
                         ids=["topk-onehot-t1", "topk-onehot-t0.7-topk4-topp0.9", "iid-specinfer-t1",
                              "iid-spectr-t0.7-topk4-topp0.9"])
def test_tree_sampling_matches_the_target_distribution(case, params):
    mode, spec = CASES[case]
    pvalues = bigram_pvalues(mode, spec, params)
    assert min(pvalues) > 1e-3, pvalues


@pytest.mark.parametrize("case", list(CASES))
def test_chi2_check_catches_a_broken_residual(case, monkeypatch):
    monkeypatch.setattr(verify, "_residual", forget_rejected)
    mode, spec = CASES[case]
    pvalues = bigram_pvalues(mode, spec, T1)
    assert min(pvalues) < 1e-6, pvalues


def test_sampled_tree_with_eagle3_matches_tiny_llama_distribution():
    """A real target, and a drafter whose q is zero outside its draft vocabulary (mapped to the target's)."""
    target = tiny_llama(vocab_size=8, num_layers=4, init=0.4)
    model = random_eagle3(target, layers=(1, 2), draft_ids=torch.tensor([1, 2, 4, 5, 7]), scale=0.4)
    params, prompt = T1, [1, 5, 3]
    counts = tree_counts(target, lambda: Eagle3Drafter(model), prompt, 8, "sample", TreeSpec(3, 2, None, "iid"),
                         params, 600, 3)
    exact = enumerate_marginals(target, prompt, 3, 8, params)
    pvalues = [chi2_pvalue(counts[j], exact[j]) for j in range(3)]
    assert min(pvalues) > 1e-3, pvalues


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_kseq_rho_solves_its_equation(k):
    gen = torch.Generator().manual_seed(k)
    p, q = torch.rand(10, generator=gen).softmax(0), (torch.rand(10, generator=gen) * 3).softmax(0)
    rho = kseq_rho(p, q, k)
    beta = float(torch.minimum(q.double(), p.double() / rho).sum())
    assert 1 <= rho <= k
    assert abs(1 - (1 - beta) ** k - rho * beta) < 1e-9
    accept = torch.minimum(rho * q, p)  # P(x accepted); the residual covers the rest of p exactly
    assert float(accept.sum()) == pytest.approx(1 - (1 - beta) ** k, abs=1e-6)
