"""Draft trees (decoding/tree.py): masks and positions against sequential forwards, EAGLE-2 tree growth against a
naive reference, greedy losslessness for every drafter kind, the chain as a one-path tree, drafter caches after a
tree pass, and the per-depth statistics."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from drafter_train.decoding.autoregressive import generate_autoregressive
from drafter_train.decoding.cached_lm import CachedLM
from drafter_train.decoding.drafter import ARDrafter
from drafter_train.decoding.sampling import SamplingParams
from drafter_train.decoding.speculative import generate_speculative, generate_tree_speculative
from drafter_train.decoding.tree import DraftTree, TreeSpec, ancestors, build_topk_tree, verify_inputs
from drafter_train.decoding.verify import make_tree_verifier, make_verifier, verify_tree_greedy
from drafter_train.drafters.eagle3.model import Eagle3Drafter
from drafter_train.drafters.nar.model import SpecDrafter
from drafter_train.drafters.ngram.model import NgramConfig, NgramModel, PromptLookupDrafter
from drafter_train.drafters.registry import make_drafter
from drafter_train.drafters.common.truncated import cut_from_target
from drafter_train.features import FeatureTap
from tests.conftest import tiny_llama
from tests.stubs import BigramLM, greedy_table
from tests.test_dflash import random_dflash
from tests.test_eagle3 import random_eagle3

GREEDY = make_verifier("greedy", SamplingParams())
TREE_GREEDY = make_tree_verifier("greedy", SamplingParams())
SHAPES = [TreeSpec(1, 4, 4), TreeSpec(2, 3), TreeSpec(3, 4, 10), TreeSpec(4, 5, 16)]


def random_tree(num_nodes: int, vocab: int, seed: int = 0) -> DraftTree:
    gen = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(1, num_nodes)]
    return DraftTree(torch.randint(3, vocab, (num_nodes,), generator=gen), torch.tensor(parents))


def path_to(tree: DraftTree, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = int(tree.parents[node])
    return path[::-1]


# ---- masks, positions, one pass for the whole tree ----------------------------------------------------------------


def test_ancestor_rows_match_a_naive_walk():
    tree = random_tree(12, 64)
    allowed = ancestors(tree.parents)
    for i in range(12):
        assert {c - 1 for c in allowed[i + 1].nonzero().flatten().tolist() if c} == set(path_to(tree, i))
        assert allowed[i + 1, 0]  # every node sees the root
    assert allowed[0].tolist() == [True] + [False] * 12


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@torch.no_grad()
def test_tree_pass_equals_sequential_forwards_of_each_path(attn):
    """Row i + 1 of one tree pass = the last logits of a plain forward over prefix + root + path to node i; the
    cache then keeps prefix + root + one path by index selection, and decoding continues exactly."""
    target = tiny_llama(vocab_size=64, num_layers=3)
    target.config._attn_implementation = attn
    prefix, tree = torch.tensor([1, 7, 9, 30, 12]), random_tree(10, 64, seed=3)
    lm = CachedLM(target)
    lm.forward(prefix[:-1], num_logits=1)
    inputs, mask, positions = verify_inputs(tree, prefix[-1], prefix.numel() - 1, target.dtype)
    assert positions[0].tolist() == [4] + (4 + tree.depths).tolist()
    logits = lm.forward_tree(inputs, mask, positions)
    for i in range(tree.num_nodes):
        ids = torch.cat([prefix, tree.tokens[path_to(tree, i)]])[None]
        torch.testing.assert_close(logits[i + 1], target(ids).logits[0, -1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[0], target(prefix[None]).logits[0, -1], rtol=1e-4, atol=1e-4)
    deepest = int(tree.depths.argmax())
    path = path_to(tree, deepest)
    lm.keep(torch.cat([torch.arange(4), 4 + torch.tensor(tree.path_rows(path))]))
    nxt = torch.tensor([5])
    expected = target(torch.cat([prefix, tree.tokens[path], nxt])[None]).logits[0, -1]
    torch.testing.assert_close(lm.forward(nxt, num_logits=1)[-1], expected, rtol=1e-4, atol=1e-4)


# ---- growing trees --------------------------------------------------------------------------------------------------


class TableDrafter:
    """A TreeDrafter whose logits after a node are a fixed function of the node's token (a bigram table)."""

    draft_ids = None

    def __init__(self, table):
        self.table = table
        self.expanded: list[list[int]] = []

    def tree_root(self, seq):
        return self.table[int(seq[-1])]

    def tree_expand(self, pool, nodes):
        self.expanded.append(nodes)
        assert len({pool.depths[n] for n in nodes}) == 1  # one depth per call
        return self.table[[pool.tokens[n] for n in nodes]]


def naive_eagle2(table, root_token, top_k, depth, total):
    """EAGLE-2 written out with plain lists: (tokens of each kept node's path, scores), best first."""
    logp = torch.log_softmax(table.double(), -1)
    nodes = []  # (score, path tokens, creation index)
    layer = [(float(s), [int(t)]) for s, t in zip(*logp[root_token].topk(top_k))]
    nodes += layer
    for _ in range(depth - 1):
        expand = sorted(layer, key=lambda n: -n[0])[:top_k]
        layer = [(score + float(s), path + [int(t)]) for score, path in expand
                 for s, t in zip(*logp[path[-1]].topk(top_k))]
        nodes += layer
    ranked = sorted(enumerate(nodes), key=lambda item: (-item[1][0], item[0]))[:total]
    return [(path, score) for _, (score, path) in ranked]


@pytest.mark.parametrize("top_k,depth,total", [(2, 3, 5), (3, 4, 20), (4, 3, 4), (1, 5, 5)])
def test_topk_tree_is_eagle2s_best_nodes_in_order(top_k, depth, total):
    table = torch.randn(12, 12, generator=torch.Generator().manual_seed(top_k * 10 + depth)) * 2
    drafter = TableDrafter(table.float())
    tree = build_topk_tree(drafter, torch.tensor([1, 4]), TreeSpec(top_k, depth, total), SamplingParams())
    expected = naive_eagle2(table.float(), 4, top_k, depth, total)
    got = [tree.tokens[path_to(tree, i)].tolist() for i in range(tree.num_nodes)]
    assert got == [path for path, _ in expected]
    assert (tree.parents < torch.arange(tree.num_nodes)).all()  # connected, parents first
    assert len(drafter.expanded) == depth - 1 and all(len(nodes) == top_k for nodes in drafter.expanded[1:])


def test_smaller_tree_is_the_larger_trees_best_nodes():
    table = torch.randn(16, 16, generator=torch.Generator().manual_seed(5)) * 2
    big = build_topk_tree(TableDrafter(table), torch.tensor([3]), TreeSpec(3, 4, 24), SamplingParams())
    for n in (4, 7, 12):
        small = build_topk_tree(TableDrafter(table), torch.tensor([3]), TreeSpec(3, 4, n), SamplingParams())
        assert torch.equal(small.tokens, big.tokens[:n]) and torch.equal(small.parents, big.parents[:n])


def test_greedy_tree_verification_on_hand_written_logits():
    # root -> {a=4, b=5}; a -> {c=6}; b -> {d=7, e=8}. Target: after root 5, after b 8, after e 2.
    tree = DraftTree(torch.tensor([4, 5, 6, 7, 8]), torch.tensor([-1, -1, 0, 1, 1]))
    logits = torch.zeros(6, 10)
    for row, token in ((0, 5), (1, 9), (2, 8), (3, 9), (4, 9), (5, 2)):
        logits[row, token] = 5.0
    path, token = verify_tree_greedy(tree, logits)
    assert (path, int(token)) == ([1, 4], 2)  # b, e, then the bonus token after the leaf e
    logits[0] = 0
    logits[0, 3] = 5.0
    path, token = verify_tree_greedy(tree, logits)
    assert (path, int(token)) == ([], 3)  # no child of the root matches: the target's token


@torch.no_grad()
def test_nar_tree_children_are_the_top_k_of_their_block_position():
    """A one-pass drafter's tree: one drafter pass, and every expanded node's children are the top-k tokens of the
    next block position's distribution (whatever its parent drafted)."""
    target = tiny_llama(vocab_size=64, num_layers=4, init=0.4)
    drafter = kind_drafter("nar", target)
    drafter.reset()
    seq = torch.tensor([1, 5, 9, 33, 7])
    block = drafter.model.draft_logits(seq, drafter.caches)  # the one pass, computed here by hand
    drafter.reset()
    tree = build_topk_tree(drafter, seq, TreeSpec(3, 3), SamplingParams())
    assert tree.num_nodes == TreeSpec(3, 3).candidates()
    assert set(tree.tokens[tree.children[0]].tolist()) == set(block[0].topk(3).indices.tolist())
    for node, children in enumerate(tree.children[1:]):
        if children:
            depth = int(tree.depths[node])  # 1-based: its children sit at block position `depth`
            assert set(tree.tokens[children].tolist()) == set(block[depth].topk(3).indices.tolist())
    assert sum(1 for c in tree.children[1:] if c) == 3 * 2  # top_k nodes expanded at each of the first two depths


# ---- greedy decoding with trees is lossless, for every drafter kind -----------------------------------------------


def kind_drafter(kind, target):
    if kind == "ngram":
        return PromptLookupDrafter(NgramModel(NgramConfig(vocab_size=target.config.vocab_size)))
    if kind == "ar":
        return ARDrafter(cut_from_target(target, 2))
    if kind == "nar":
        torch.manual_seed(0)
        return make_drafter(SpecDrafter.from_target(target, 2, 0, 5).eval())
    if kind == "dflash":
        return make_drafter(random_dflash(target, layers=(1, 2), block_size=6, draft_ids=torch.arange(2, 64, 2)))
    return make_drafter(random_eagle3(target, draft_ids=torch.arange(2, 64, 2), scale=0.4))


@pytest.mark.parametrize("kind", ["ar", "nar", "eagle3", "dflash", "ngram"])
@pytest.mark.parametrize("spec", SHAPES, ids=lambda s: f"k{s.top_k}d{s.depth}")
def test_greedy_tree_decoding_is_lossless(kind, spec):
    target = tiny_llama(vocab_size=64, num_layers=4, init=0.4)
    prompt = [1, 5, 9, 33, 7]
    ar = generate_autoregressive(target, prompt, 40)
    out = generate_tree_speculative(target, kind_drafter(kind, target), prompt, spec, TREE_GREEDY, 40)
    assert out.tokens == ar.tokens
    # every target pass yields the accepted path + 1 token, so the counts must add up exactly
    assert out.stats.target_forward_passes + out.stats.accepted == len(ar.tokens)


@pytest.mark.parametrize("spec", [TreeSpec(1, 4, 4), TreeSpec(1, 2)], ids=lambda s: f"k{s.top_k}d{s.depth}")
def test_a_tree_drafted_by_the_target_itself_is_accepted_to_its_full_depth(spec):
    """Drafter == target, top-1 trees (the drafter's greedy chain, which a pruned wider tree need not keep): each pass
    must accept `depth` drafts (fewer only where max_new_tokens leaves less), 1 + ceil(39 / (depth + 1)) passes for
    40 tokens."""
    target = tiny_llama(vocab_size=64, num_layers=2, init=0.4)
    out = generate_tree_speculative(target, ARDrafter(target), [1, 5, 9, 33, 7], spec, TREE_GREEDY, 40)
    passes = 1 + -(-39 // (spec.depth + 1))
    assert (out.stats.target_forward_passes, out.stats.accepted) == (passes, 40 - passes)
    assert out.stats.per_position_acceptance == [1.0] * spec.depth


@pytest.mark.parametrize("kind", ["ar", "nar", "eagle3", "dflash"])
def test_a_wider_tree_accepts_more_than_the_chain(kind):
    target = tiny_llama(vocab_size=64, num_layers=4, init=0.4)
    prompts = [[1, 5, 9, 33, 7], [1, 12, 40, 3], [1, 60, 2, 18, 19, 20]]
    chain = tree = 0
    for prompt in prompts:
        chain += generate_speculative(target, kind_drafter(kind, target), prompt, 4, GREEDY, 32).stats.accepted
        tree += generate_tree_speculative(target, kind_drafter(kind, target), prompt, TreeSpec(4, 4, 24), TREE_GREEDY,
                                          32).stats.accepted
    assert tree > chain


def test_greedy_tree_decoding_is_lossless_on_stories260k(stories_path):
    target = AutoModelForCausalLM.from_pretrained(stories_path, dtype=torch.float32).eval()
    prompt = [1, 403, 407, 261, 378, 425]
    ar = generate_autoregressive(target, prompt, 64, eos_token_ids=[2])
    for spec in (TreeSpec(2, 4, 8), TreeSpec(4, 6, 24)):
        out = generate_tree_speculative(target, ARDrafter(cut_from_target(target, 2)), prompt, spec, TREE_GREEDY, 64,
                                        eos_token_ids=[2])
        assert out.tokens == ar.tokens
        assert 0 < out.stats.accepted < out.stats.proposed


# ---- a chain is a tree with one path --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["ar", "nar", "eagle3"])
def test_chain_as_a_tree_gives_the_chain_decoders_outputs_and_stats(kind):
    target = tiny_llama(vocab_size=64, num_layers=4, init=0.4)
    prompt, draft_len = [1, 5, 9, 33, 7], 4
    chain = generate_speculative(target, kind_drafter(kind, target), prompt, draft_len, GREEDY, 40)
    tree = generate_tree_speculative(target, kind_drafter(kind, target), prompt, TreeSpec(1, draft_len, draft_len),
                                     TREE_GREEDY, 40)
    assert tree.tokens == chain.tokens
    a, b = chain.stats.summary(), tree.stats.summary()
    for key in ("drafter_ms_per_proposal", "drafter_ms_per_step", "verify_ms_per_step"):  # timings
        a.pop(key), b.pop(key)
    assert a == b
    assert chain.stats.accepted_within == tree.stats.accepted_within


def test_chain_as_a_sampled_tree_gives_the_chain_decoders_samples():
    """One i.i.d. draft sequence is a chain: the same draws, the same acceptance tests, the same outputs."""
    target = tiny_llama(vocab_size=64, num_layers=4, init=0.4)
    drafter_model = cut_from_target(target, 2)
    params = SamplingParams(temperature=1.0)
    for seed in range(4):
        chain = generate_speculative(target, ARDrafter(drafter_model), [1, 5, 9], 3, make_verifier("sample", params),
                                     24, params, generator=torch.Generator().manual_seed(seed))
        for rule in ("sample", "spectr"):
            tree = generate_tree_speculative(target, ARDrafter(drafter_model), [1, 5, 9], TreeSpec(1, 3, None, "iid"),
                                             make_tree_verifier(rule, params), 24, params,
                                             generator=torch.Generator().manual_seed(seed))
            assert tree.tokens == chain.tokens and tree.stats.accepted == chain.stats.accepted


# ---- drafter state after a tree pass --------------------------------------------------------------------------------


def cache_tensors(cache: DynamicCache, length: int):
    return [(layer.keys[..., :length, :], layer.values[..., :length, :]) for layer in cache.layers]


@pytest.mark.parametrize("kept", [[0, 1, 2, 3, 4, 5, 7, 9], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 2, 3, 8], [1, 4],
                                  [0, 1, 2, 3, 4, 5, 6, 7], []])
@torch.no_grad()
def test_keep_equals_an_index_selection_of_the_cache(kept):
    """keep() moves only the rows after the leading ones in place; the cache must equal selecting every kept row."""
    lm = CachedLM(tiny_llama(vocab_size=64, num_layers=2))
    lm.forward(torch.arange(1, 11), num_logits=1)
    expected = [(layer.keys.index_select(-2, torch.tensor(kept, dtype=torch.long)),
                 layer.values.index_select(-2, torch.tensor(kept, dtype=torch.long))) for layer in lm.cache.layers]
    lm.keep(torch.tensor(kept, dtype=torch.long))
    assert lm.length == len(kept) == lm.cache.get_seq_length()
    for layer, (keys, values) in zip(lm.cache.layers, expected):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


@torch.no_grad()
def test_ar_drafter_cache_after_tree_steps_equals_a_fresh_forward():
    target = tiny_llama(vocab_size=64, num_layers=4, init=0.4)
    drafter_model = cut_from_target(target, 2)
    drafter = ARDrafter(drafter_model)
    out = generate_tree_speculative(target, drafter, [1, 5, 9, 33, 7], TreeSpec(3, 4, 12), TREE_GREEDY, 30)
    seq = torch.tensor([1, 5, 9, 33, 7] + out.tokens)
    held = drafter.lm.length
    assert out.stats.accepted > 0 and held >= 5
    fresh = CachedLM(drafter_model)
    fresh.forward(seq[:held], num_logits=1)
    for (k, v), (fk, fv) in zip(cache_tensors(drafter.lm.cache, held), cache_tensors(fresh.cache, held)):
        torch.testing.assert_close(k, fk, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, fv, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_eagle3_tree_decoding_keeps_the_drafter_state_of_a_chain_run():
    """Tree decoding with EAGLE-3 is greedy-lossless, and the drafter's committed state (step-0 cache entries from
    the accepted path's target features) equals that of a fresh drafter given the whole sequence's features."""
    target = tiny_llama(vocab_size=64, num_layers=4, init=0.4)
    model = random_eagle3(target, draft_ids=torch.arange(2, 64, 2), scale=0.4)
    drafter, prompt = Eagle3Drafter(model), [1, 5, 9, 33, 7]
    out = generate_tree_speculative(target, drafter, prompt, TreeSpec(3, 4, 12), TREE_GREEDY, 30)
    assert out.tokens == generate_autoregressive(target, prompt, 30).tokens and out.stats.accepted > 0
    seq = torch.tensor(prompt + out.tokens)
    drafter._step0(seq)  # move the last commit's features into the cache
    held = drafter.length
    fresh = Eagle3Drafter(model)
    with FeatureTap(target, model.config.target_layers) as tap:
        target(input_ids=seq[None, :held])
        fresh.commit(held, tap.features[0])
    fresh._step0(seq)
    for (k, v), (fk, fv) in zip(cache_tensors(drafter.cache, held), cache_tensors(fresh.cache, held)):
        torch.testing.assert_close(k, fk, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v, fv, rtol=1e-4, atol=1e-4)


# ---- statistics -----------------------------------------------------------------------------------------------------


def test_tree_stats_count_depths_on_hand_written_bigrams():
    """Target cycles 0->1->2->3->0. The drafter's best guess after 1 is wrong (0), its second best right (2): a
    chain stops there, a top_k=2 tree takes the second branch."""
    target = BigramLM(greedy_table({0: 1, 1: 2, 2: 3, 3: 0}, 4))
    table = greedy_table({0: 1, 1: 0, 2: 3, 3: 0}, 4)
    table[1, 2] = 5.0  # second best after 1
    chain = generate_tree_speculative(target, ARDrafter(BigramLM(table)), [0], TreeSpec(1, 3, 3), TREE_GREEDY, 13)
    tree = generate_tree_speculative(target, ARDrafter(BigramLM(table)), [0], TreeSpec(2, 3, 6), TREE_GREEDY, 13)
    ar = generate_autoregressive(target, [0], 13).tokens
    assert chain.tokens == tree.tokens == ar
    assert tree.stats.tau > chain.stats.tau
    s = tree.stats
    assert sum(s.accepted_hist) == s.proposals and s.accepted == sum(m * c for m, c in enumerate(s.accepted_hist))
    assert s.per_position_acceptance[0] == 1.0  # a depth-1 node is always right with two guesses
    assert s.reached[0] == s.proposals and s.accepted_at[0] <= s.reached[0]


# ---- prompt lookup: a retrieval tree -------------------------------------------------------------------------------


def test_prompt_lookup_tree_children_follow_the_matching_suffix():
    drafter = PromptLookupDrafter(NgramModel(NgramConfig(min_ngram=1, max_ngram=3, vocab_size=12)))
    seq = torch.tensor([5, 6, 7, 5, 6, 8, 5, 6])  # [5, 6] occurred twice: followed by 7, then (more recently) 8
    tree = build_topk_tree(drafter, seq, TreeSpec(2, 2), SamplingParams())
    paths = [tree.tokens[path_to(tree, i)].tolist() for i in range(tree.num_nodes)]
    # the more recent follower first; the only follower of a path has probability 1: it ranks right after its parent
    assert paths == [[8], [8, 5], [7], [7, 5]]
    assert build_topk_tree(drafter, torch.tensor([1, 2, 3]), TreeSpec(2, 2), SamplingParams()).num_nodes == 0


@pytest.mark.parametrize("spec,mode", [(TreeSpec(2, 4, 6), "greedy"), (TreeSpec(2, 3, None, "iid"), "sample")])
def test_prompt_lookup_trees_accept_a_repeating_target(spec, mode):
    """A target that cycles 0->1->2->3: no match at first (plain steps, nothing counted as a proposal), then the
    lookup tree predicts every token."""
    target = BigramLM(greedy_table({0: 1, 1: 2, 2: 3, 3: 0}, 4, scale=30.0))
    drafter = PromptLookupDrafter(NgramModel(NgramConfig(vocab_size=4)))
    params = SamplingParams() if mode == "greedy" else SamplingParams(temperature=1.0)
    out = generate_tree_speculative(target, drafter, [0], spec, make_tree_verifier(mode, params), 30, params,
                                    generator=torch.Generator().manual_seed(0))
    assert out.tokens == [(i + 1) % 4 for i in range(30)]
    assert out.stats.acceptance_rate > 0.5 and out.stats.tau > 2
    assert out.stats.proposals < out.stats.target_forward_passes - 1  # the first steps proposed nothing
