"""Draft trees: what a drafter proposes when several continuations are verified in one target pass.

A tree holds N draft nodes in topological order (every parent before its children). `parents[i] = -1`: node i
follows the ROOT, the last verified token seq[-1]; otherwise the index of its parent node. A chain of k drafts is the
tree with parents [-1, 0, 1, ..., k - 2].

The target reads the root and every node in one pass: row 0 is the root, row i + 1 is node i, at position
(prefix length + depth), attending to the cached prefix, its ancestors and itself (`attention_mask`). Row r's
logits are the target's distribution AFTER row r, i.e. over the children of that node.

Two ways to grow a tree, both through the same two drafter calls (`TreeDrafter`):
- `topk` (EAGLE-2's dynamic tree, arXiv 2406.16858): a node's score is its cumulative draft log-probability; each
  depth expands the `top_k` best nodes of the previous depth into their `top_k` most likely children; at the end
  the `total_tokens` best nodes of all candidates are kept. A child never scores above its parent, so the kept set
  is a connected tree. Nodes come out best first: the first n nodes of a tree are the tree with total_tokens = n.
- `iid` (SpecInfer / SpecTr): `top_k` draft sequences of `depth` tokens, each token sampled from the drafter; equal
  prefixes share nodes, and `counts[i]` says how many sequences pass through node i.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Protocol

import torch
from torch import Tensor

from drafter_train.decoding.sampling import SamplingParams, logits_to_probs, sample


@dataclass(frozen=True)
class TreeSpec:
    """The shape of the trees to draft (config: eval.tree)."""

    top_k: int
    depth: int
    total_tokens: Optional[int] = None  # topk: None = every candidate; iid: unused
    branching: str = "topk"  # topk | iid

    def candidates(self, depth: Optional[int] = None) -> int:
        """How many nodes a topk tree of this shape can hold at most (its candidate pool)."""
        depth = self.depth if depth is None else depth
        return self.top_k + (depth - 1) * self.top_k ** 2

    def nodes(self, depth: Optional[int] = None) -> int:
        """The most draft nodes one tree of this spec holds (cut to `depth` near the end of a sequence)."""
        depth = self.depth if depth is None else depth
        if self.branching == "iid":
            return self.top_k * depth
        return min(self.total_tokens or self.candidates(depth), self.candidates(depth))

    def describe(self) -> str:
        size = "" if self.branching == "iid" else f", total_tokens={self.nodes()}"
        return f"tree {self.branching} top_k={self.top_k}, depth={self.depth}{size}"


@dataclass
class DraftTree:
    """N draft nodes (topological order) and what verification needs to know about how they were drawn."""

    tokens: Tensor  # [N] long, target vocabulary
    parents: Tensor  # [N] long, -1 = the root
    # [N, V] the processed draft distribution node i's token was SAMPLED from (iid trees); None: nodes were chosen
    # deterministically (topk trees), and verification treats each one's q as one-hot.
    q_draft: Optional[Tensor] = None
    # [N] draft sequences passing through node i (iid trees); None: one each.
    counts: Optional[Tensor] = None
    # [N] the candidate id each node had while the drafter expanded the tree (the drafter's caches are keyed by it).
    pool_ids: Optional[Tensor] = None
    # Made by prompt lookup ahead of the drafter (eval.lookup, `lookup_tree`): a chain the drafter did not see.
    from_lookup: bool = False

    @property
    def num_nodes(self) -> int:
        return self.tokens.numel()

    @cached_property
    def depths(self) -> Tensor:
        """[N] depth of each node (1 = a child of the root)."""
        return node_depths(self.parents)

    @cached_property
    def children(self) -> list[list[int]]:
        """children[r]: the nodes whose parent is row r's node (r = 0: the root, r = i + 1: node i), in node order."""
        rows: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]
        for i, parent in enumerate(self.parents.tolist()):
            rows[parent + 1].append(i)
        return rows

    @cached_property
    def draw_slots(self) -> Tensor:
        """[N] index of node i's first draw among all draws (iid trees draw a node counts[i] times)."""
        counts = self.node_counts
        return torch.cumsum(counts, 0) - counts

    @cached_property
    def node_counts(self) -> Tensor:
        return self.counts if self.counts is not None else torch.ones_like(self.tokens)

    @property
    def num_draws(self) -> int:
        return int(self.node_counts.sum())

    def draws(self, row: int, generator: Optional[torch.Generator]) -> list[tuple[int, int]]:
        """The draws of row `row`'s children as (node, draw slot), in the order verification tests them.

        Distinct siblings of an iid tree were drawn as a multiset; the sequences' draws are exchangeable, so a
        uniformly random order of the multiset is distributed as the order they were drawn in (rejection rules
        depend on that order, grouping equal tokens would bias them). Deterministic trees: node order (best first).
        """
        kids = self.children[row]
        draws = [(node, int(self.draw_slots[node]) + j) for node in kids for j in range(int(self.node_counts[node]))]
        if self.counts is not None and len(kids) > 1:
            device = generator.device if generator is not None else None  # a CUDA generator draws on its device
            order = torch.randperm(len(draws), generator=generator, device=device).tolist()
            draws = [draws[i] for i in order]
        return draws

    def path_rows(self, path: list[int]) -> list[int]:
        """Verify-pass rows of the root and an accepted path (root = row 0, node i = row i + 1)."""
        return [0] + [node + 1 for node in path]


def node_depths(parents: Tensor) -> Tensor:
    depths: list[int] = []
    for parent in parents.tolist():
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return torch.tensor(depths, dtype=torch.long, device=parents.device)


def ancestors(parents: Tensor) -> Tensor:
    """[N + 1, N + 1] bool: row r may attend to row c (c is r or an ancestor of r; row 0 = the root)."""
    n = parents.numel()
    allowed = torch.eye(n + 1, dtype=torch.bool, device=parents.device)
    allowed[:, 0] = True
    for i, parent in enumerate(parents.tolist()):
        allowed[i + 1] |= allowed[parent + 1]
        allowed[i + 1, i + 1] = True
    return allowed


def attention_mask(allowed: Tensor, past: int, dtype: torch.dtype) -> Tensor:
    """Additive mask [1, 1, q, past + kv] for q new rows over `past` cached positions (all visible) and kv new or
    tree positions (`allowed` [q, kv] bool). Float in the model's dtype: a bool 4-D mask is silently wrong under
    eager attention in transformers 5 (added as 0/1), and every row must see something (sdpa gives NaN otherwise)."""
    q = allowed.shape[0]
    visible = torch.cat([torch.ones(q, past, dtype=torch.bool, device=allowed.device), allowed], dim=1)
    mask = torch.zeros(visible.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill(~visible, torch.finfo(dtype).min)[None, None]


def verify_inputs(tree: DraftTree, root: Tensor, past: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """What the target's tree pass reads: tokens [N + 1] (root first), additive mask [1, 1, N + 1, past + N + 1]
    and position ids [1, N + 1] (past + depth; the root sits at `past`)."""
    tokens = torch.cat([root.view(1), tree.tokens])
    depths = torch.cat([tree.depths.new_zeros(1), tree.depths])
    return tokens, attention_mask(ancestors(tree.parents), past, dtype), (past + depths)[None]


# ----------------------------------------------------------------------------------------------------------------
# Growing trees


class TreePool:
    """The candidate nodes of a tree while it grows (ids in order of creation; parents before children)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.scores: list[float] = []

    def add(self, tokens: Tensor, parents: list[int], scores: Tensor) -> list[int]:
        """Append nodes; returns their ids."""
        first = len(self.tokens)
        self.tokens += tokens.tolist()
        self.parents += parents
        self.depths += [1 if p < 0 else self.depths[p] + 1 for p in parents]
        self.scores += scores.tolist()
        return list(range(first, len(self.tokens)))

    def ancestors_of(self, node: int) -> list[int]:
        """node's ancestors, root side first, node itself last."""
        chain = []
        while node >= 0:
            chain.append(node)
            node = self.parents[node]
        return chain[::-1]

    def visible(self, rows: list[int], columns: list[int]) -> Tensor:
        """[len(rows), len(columns)] bool: column node is an ancestor of (or is) row node."""
        lines = [set(self.ancestors_of(r)) for r in rows]
        return torch.tensor([[c in line for c in columns] for line in lines], dtype=torch.bool, device=self.device)


class TreeDrafter(Protocol):
    """The two calls a drafter kind implements so that the decoder can grow trees from it (both kinds of tree).
    After the tree pass the decoder calls the drafter's `commit(num_valid, features, path)` with the accepted nodes'
    candidate ids (`DraftTree.pool_ids`), so that its caches keep the prefix and that path only."""

    # [Vd] target id of each entry of the drafter's vocabulary; None: it drafts over the target's vocabulary (with
    # draft_ids set, `draft_vocab` [V] bool marks the target ids it covers).
    draft_ids: Optional[Tensor]

    def tree_root(self, seq: Tensor) -> Tensor:
        """Read what was verified since the last call (seq [L]: prompt + accepted tokens) and return the draft logits
        [Vd] of the position after seq[-1] (the root's children)."""

    def tree_expand(self, pool: TreePool, nodes: list[int]) -> Tensor:
        """Draft logits [n, Vd] of the position after each of `nodes` (candidate ids in `pool`, all at one depth;
        their ancestors were expanded by earlier calls of this proposal)."""


def _draft_logprobs(logits: Tensor, params: SamplingParams) -> Tensor:
    """What a node is scored by: log of the processed draft distribution (greedy: the plain softmax). A drafter with
    nothing to propose after a node (all logits -inf: prompt lookup without a match) gives it no children."""
    logprobs = torch.log_softmax(logits.float(), dim=-1) if params.greedy else torch.log(logits_to_probs(logits, params))
    return logprobs.masked_fill(torch.isnan(logprobs), float("-inf"))


def _has_mass(probs: Tensor) -> bool:
    return bool(torch.isfinite(probs).all() and probs.sum() > 0)


def _to_target(drafter: TreeDrafter, ids: Tensor) -> Tensor:
    return ids if drafter.draft_ids is None else drafter.draft_ids[ids]


def build_topk_tree(drafter: TreeDrafter, seq: Tensor, spec: TreeSpec, params: SamplingParams) -> DraftTree:
    """EAGLE-2's dynamic tree (see the module doc); `spec.depth` expansions, the best spec.nodes() nodes kept."""
    pool = TreePool(seq.device)
    logprobs = _draft_logprobs(drafter.tree_root(seq), params)  # [Vd]
    top_k = min(spec.top_k, logprobs.shape[-1])
    top = logprobs.topk(top_k)  # values/indices [top_k]
    frontier = pool.add(_to_target(drafter, top.indices), [-1] * top_k, top.values)
    for _ in range(spec.depth - 1):
        scores = torch.tensor([pool.scores[i] for i in frontier])
        expand = [frontier[i] for i in scores.topk(min(top_k, len(frontier))).indices.tolist()]
        expand = [node for node in expand if pool.scores[node] > float("-inf")]
        if not expand:
            break
        top = _draft_logprobs(drafter.tree_expand(pool, expand), params).topk(top_k, dim=-1)  # [n, top_k]
        cumulative = torch.tensor([pool.scores[i] for i in expand])[:, None] + top.values.cpu()
        parents = [node for node in expand for _ in range(top_k)]
        frontier = pool.add(_to_target(drafter, top.indices.reshape(-1)), parents, cumulative.reshape(-1))
    return _best_nodes(pool, spec.nodes(spec.depth))


def _best_nodes(pool: TreePool, total: int) -> DraftTree:
    """The `total` best-scoring candidates (ties: the earlier one, so a parent precedes its children), reindexed in
    that order; candidates the drafter gives probability 0 are never kept."""
    scores = torch.tensor(pool.scores, dtype=torch.float64)
    order = torch.argsort(-scores, stable=True)[:total]
    order = order[torch.isfinite(scores[order])]
    new_id = {int(old): new for new, old in enumerate(order.tolist())}
    parents = [new_id[pool.parents[int(old)]] if pool.parents[int(old)] >= 0 else -1 for old in order]
    device = pool.device
    tokens = torch.tensor([pool.tokens[int(old)] for old in order], dtype=torch.long, device=device)
    return DraftTree(tokens, torch.tensor(parents, dtype=torch.long, device=device), pool_ids=order.to(device))


def build_iid_tree(drafter: TreeDrafter, seq: Tensor, spec: TreeSpec, params: SamplingParams,
                   generator: Optional[torch.Generator]) -> DraftTree:
    """`spec.top_k` draft sequences of `spec.depth` tokens, each token sampled from the drafter's distribution after
    the sequence's own prefix; equal prefixes share nodes."""
    pool, q_rows, counts = TreePool(seq.device), [], []
    dist = {-1: _full_vocab(drafter, logits_to_probs(drafter.tree_root(seq), params))}  # node -> q after it [V]
    at = [-1] * spec.top_k  # the node each sequence has reached (-1: the root)
    for depth in range(spec.depth):
        live = [s for s, node in enumerate(at) if _has_mass(dist[node])]  # sequences the drafter can continue
        if not live:
            break
        drawn = sample(torch.stack([dist[at[s]] for s in live]), generator).tolist()  # one draw each
        made: dict[tuple[int, int], int] = {}
        for s, token in zip(live, drawn):
            parent = at[s]
            if (parent, token) not in made:
                (made[parent, token],) = pool.add(torch.tensor([token]), [parent], torch.zeros(1))
                q_rows.append(dist[parent])
                counts.append(0)
            at[s] = made[parent, token]
            counts[at[s]] += 1
        at = [node for s, node in enumerate(at) if s in live]  # a sequence the drafter could not continue ends
        if depth + 1 < spec.depth:
            new = list(made.values())
            probs = _full_vocab(drafter, logits_to_probs(drafter.tree_expand(pool, new), params))  # [n, V]
            dist = dict(zip(new, probs))
    device = seq.device
    return DraftTree(torch.tensor(pool.tokens, dtype=torch.long, device=device),
                     torch.tensor(pool.parents, dtype=torch.long, device=device),
                     q_draft=torch.stack(q_rows) if q_rows else None,
                     counts=torch.tensor(counts, dtype=torch.long, device=device),
                     pool_ids=torch.arange(len(pool.tokens), device=device))


def lookup_tree(drafter, seq: Tensor, max_len: int) -> Optional[DraftTree]:
    """Prompt lookup ahead of the drafter (eval.lookup: drafters/ngram.LookupFirst): where the sequence's last
    n-gram occurred earlier (or the corpus continues it), its chain of up to `max_len` drafts, as a tree with one path
    of deterministic nodes; None where nothing matches, or no lookup runs in front of this drafter."""
    lookup = getattr(drafter, "lookup_chain", None)
    drafts = lookup(seq, max_len) if lookup is not None and max_len > 0 else None
    if drafts is None or not drafts.numel():
        return None
    parents = torch.arange(-1, drafts.numel() - 1, device=drafts.device)
    return DraftTree(drafts, parents, from_lookup=True)


def build_tree(drafter: TreeDrafter, seq: Tensor, spec: TreeSpec, params: SamplingParams,
               generator: Optional[torch.Generator]) -> DraftTree:
    if spec.branching == "iid":
        return build_iid_tree(drafter, seq, spec, params, generator)
    return build_topk_tree(drafter, seq, spec, params)


def _full_vocab(drafter: TreeDrafter, probs: Tensor) -> Tensor:
    """[..., Vd] draft probabilities -> [..., V] over the target's vocabulary (zero outside the draft vocabulary)."""
    if drafter.draft_ids is None:
        return probs
    full = probs.new_zeros(*probs.shape[:-1], drafter.draft_vocab.numel())
    return full.index_copy_(-1, drafter.draft_ids, probs)
