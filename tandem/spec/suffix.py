"""Suffix decoding: propose what followed the longest recent match of the request's tail.

SuffixDecoding (arXiv 2411.04975; ArcticInference's SuffixDecodingCache, vLLM's "suffix"
method) keeps suffix trees of bounded depth over token sequences and, each step, looks up
the request's last few tokens in them and proposes the most frequent continuation. Agent
traffic repeats itself (tool-call JSON, file contents echoed back, the same plan re-stated),
so the continuation is often right for many tokens at no model cost.

Two trees are consulted, as in Arctic:

* a per-request tree over the request's own prompt and output so far, extended by the new
  tokens each step and dropped when the request ends;
* a global tree over the outputs of recently finished requests (outputs only, as Arctic),
  FIFO-bounded by `max_cached_requests` whole requests; an evicted request's occurrences are
  subtracted again, so the tree is always exactly the tree of the requests still cached.

Each tree counts, for every substring of length <= `max_tree_depth` of its sequences, how
many times it occurs (its node's `count`). A continuation's estimated probability is the
product of `child.count / node.count` along its path, Arctic's estimate. The structure is a
trie of all those substrings in which every part that occurs once is not built node by node
but kept as one `_Leaf`, a reference to where that single occurrence lies in its sequence.
Most windows of real text are unique, so this stores and indexes far fewer objects than the
plain trie (which holds depth x tokens nodes) while answering exactly as it would; a node
becomes real only when a second occurrence reaches it, and becomes a leaf again when
eviction takes it back to one occurrence.

Pure Python and torch-free: it runs in the engine core once per decoding request per step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.spec.proposer import TokenProposer

# Float slack for floor(match_len * factor + offset), as Arctic: 3 * (1/3) must give 1.
_EPS = 1e-6
# Scores closer than this are a tie (decided by match length, not by rounding: 2/3 + 1/3 and
# 1.0 must compare equal).
_TIE = 1e-9


@dataclass(frozen=True)
class SuffixConfig:
    """vLLM's suffix-decoding knobs, with its defaults.

    max_tree_depth: longest substring a tree holds; it bounds both how much of the tail is
        matched and match length + proposal length (a proposal continues a stored substring).
    max_cached_requests: finished requests whose outputs the global tree keeps (FIFO of
        whole requests); 0 disables the global tree.
    max_spec_factor, max_spec_offset: a match of m tokens may propose at most
        floor(factor * m + offset) tokens, so short, weak matches propose little.
    min_token_prob: stop extending a proposal once the estimated probability of its path
        (the product of branch frequency ratios) falls below this.
    """

    max_tree_depth: int = 24
    max_cached_requests: int = 10000
    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.max_tree_depth < 2:
            raise ValueError(f"max_tree_depth must be >= 2, got {self.max_tree_depth}")
        if self.max_cached_requests < 0:
            raise ValueError(f"max_cached_requests must be >= 0, got {self.max_cached_requests}")
        if self.max_spec_factor < 0:
            raise ValueError(f"max_spec_factor must be >= 0, got {self.max_spec_factor}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {self.min_token_prob}")


@dataclass(frozen=True)
class SuffixDraft:
    """A proposal and why: `score` is the sum of its tokens' path probabilities (its expected
    accepted length under the tree's estimate), `match_len` the tail length it continues,
    `source` "request" or "global" (or "" for no proposal)."""

    tokens: list[int]
    score: float = 0.0
    match_len: int = 0
    source: str = ""


class _Node:
    """A substring that occurs at least twice (or the root, the empty string).

    `best` caches the most frequent child so a proposal walks down in O(1) per token; of
    children with equal counts the one that reached its count last wins, i.e. the most
    recently seen continuation (after an eviction, which leaves `best` None with children
    present, it is recomputed and ties go to the last child in the dict instead). `wseq`/`wstart` name the newest occurrence passing through: under
    FIFO eviction that is the one left when eviction brings the count back to 1, which is
    what the node turns back into a leaf with."""

    __slots__ = ("count", "children", "best", "token", "wseq", "wstart")

    def __init__(self, count: int, token: int, wseq: list[int] | None, wstart: int) -> None:
        self.count = count
        self.children: dict[int, _Node | _Leaf] = {}
        self.best: _Node | _Leaf | None = None
        self.token = token
        self.wseq = wseq
        self.wstart = wstart


class _Leaf:
    """The single-occurrence rest of a path: tokens seq[pos : min(start + depth, len(seq))] of
    the suffix of `seq` that starts at `start`. It grows by itself while `seq` (a request's
    live token list) grows, which is why the end is not stored."""

    __slots__ = ("seq", "start", "pos")
    count = 1

    def __init__(self, seq: list[int], start: int, pos: int) -> None:
        self.seq = seq
        self.start = start
        self.pos = pos


# A suffix being extended token by token: (its start in the sequence, the node its path ends
# at). Suffixes whose path occurs only once live in their own leaf and need no entry.
_Active = list[tuple[int, _Node]]


class _SuffixTree:
    """Occurrence counts of all substrings of length <= depth of some token sequences."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node(0, -1, None, 0)
        # Insertion rank of each indexed sequence (by id): orders occurrences across
        # sequences when a stale `best` is recomputed.
        self.rank: dict[int, int] = {}
        self._next_rank = 0

    # ---- building -------------------------------------------------------------------------

    def extend(self, seq: list[int], active: _Active, tokens: Sequence[int]) -> _Active:
        """Append `tokens` to `seq` and index them: every suffix of `seq` shorter than depth
        whose path ends at a real node moves to (or creates) its child for the token; one new
        suffix starts at the root. O(suffixes at real nodes) per token, not O(depth): a
        suffix inside its own leaf extends by itself."""
        if id(seq) not in self.rank:
            self.rank[id(seq)] = self._next_rank
            self._next_rank += 1
        depth = self.depth
        root = self.root
        leaf_cls = _Leaf
        for tok in tokens:
            pos = len(seq)
            seq.append(tok)
            root.count += 1
            active.append((pos, root))
            oldest = pos - depth  # a suffix starting here already holds `depth` tokens
            moved: _Active = []
            for start, node in active:
                if start <= oldest:
                    continue
                children = node.children
                child = children.get(tok)
                if child is None:
                    leaf = leaf_cls(seq, start, pos)
                    children[tok] = leaf
                    best = node.best
                    if len(children) == 1 or (best is not None and best.count == 1):
                        node.best = leaf
                elif child.__class__ is leaf_cls:
                    moved.append((start, self._split(node, tok, child, seq, start)))
                else:
                    count = child.count + 1
                    child.count = count
                    child.wseq = seq
                    child.wstart = start
                    best = node.best
                    if best is not None and count >= best.count:
                        node.best = child
                    moved.append((start, child))
            active = moved
        return active

    def _split(self, node: _Node, tok: int, leaf: _Leaf, seq: list[int], start: int) -> _Node:
        """A second occurrence reaches the leaf's first token: make that token a real node of
        count 2 and keep the leaf's remaining tokens, if any, as its child."""
        child = _Node(2, tok, seq, start)
        lseq = leaf.seq
        nxt = leaf.pos + 1
        if nxt < min(leaf.start + self.depth, len(lseq)):
            leaf.pos = nxt
            child.children[lseq[nxt]] = leaf
            child.best = leaf
        node.children[tok] = child
        best = node.best
        if best is leaf or (best is not None and best.count <= 2):
            node.best = child
        return child

    # ---- eviction -------------------------------------------------------------------------

    def remove(self, seq: list[int]) -> None:
        """Subtract every suffix of `seq` (which must be the oldest sequence in the tree):
        decrement counts along its paths, drop what falls to 0, then turn nodes that fell to
        a single occurrence back into leaves, so the tree is again exactly the tree of the
        other sequences."""
        depth = self.depth
        root = self.root
        n = len(seq)
        del self.rank[id(seq)]
        single: list[tuple[_Node, int, _Node, int]] = []  # (parent, token, node, node depth)
        for start in range(n):
            root.count -= 1
            node = root
            for i in range(start, min(start + depth, n)):
                tok = seq[i]
                child = node.children[tok]
                if child.__class__ is _Leaf:  # the rest of this path is this suffix alone
                    self._detach(node, tok, child)
                    break
                child.count -= 1
                if child.count == 0:
                    self._detach(node, tok, child)
                    break
                if node.best is child:
                    node.best = None  # it may no longer be the most frequent
                if child.count == 1:
                    single.append((node, tok, child, i - start + 1))
                node = child
        for parent, tok, node, node_depth in single:
            # Only the topmost node of a single-occurrence chain becomes the leaf; those below
            # it are covered by that leaf (their parent has count 1 too).
            if node.count != 1 or parent.children.get(tok) is not node:
                continue
            if parent is not root and parent.count == 1:
                continue
            wstart = node.wstart
            parent.children[tok] = _Leaf(node.wseq, wstart, wstart + node_depth - 1)
            if parent.best is node:
                parent.best = None

    @staticmethod
    def _detach(node: _Node, tok: int, child: _Node | _Leaf) -> None:
        del node.children[tok]
        if node.best is child:
            node.best = None

    # ---- proposing ------------------------------------------------------------------------

    def best_child(self, node: _Node, depth: int) -> _Node | _Leaf | None:
        """The most frequent child of `node` (at `depth`), recomputed when an eviction left
        the cache stale, with the same tie rule as the cache: the latest occurrence wins,
        which is the witness of a real child and the one occurrence of a leaf."""
        best = node.best
        if best is None and node.children:
            rank = self.rank
            top: tuple[int, int, int] | None = None
            for child in node.children.values():
                if child.__class__ is _Leaf:
                    key = (1, rank[id(child.seq)], child.pos)
                else:
                    key = (child.count, rank[id(child.wseq)], child.wstart + depth)
                if top is None or key > top:
                    best, top = child, key
            node.best = best
        return best

    def walk(self, node: _Node, depth: int, budget: int,
             min_prob: float) -> tuple[list[int], float]:
        """Greedy path below `node` (at `depth`): most frequent child each step while the
        path's estimated probability stays >= min_prob. Returns the tokens and the sum of
        their path probabilities."""
        tokens: list[int] = []
        prob = 1.0
        score = 0.0
        while True:
            child = node.best
            if child is None:
                child = self.best_child(node, depth)
                if child is None:
                    break
            prob *= child.count / node.count
            if prob < min_prob:
                break
            if child.__class__ is _Leaf:
                seq = child.seq
                pos = child.pos
                end = min(child.start + self.depth, len(seq), pos + budget - len(tokens))
                tokens += seq[pos:end]
                score += prob * (end - pos)
                break
            tokens.append(child.token)
            score += prob
            if len(tokens) >= budget:
                break
            node = child
            depth += 1
        return tokens, score

    def match(self, pattern: list[int], lo: int) -> _Node | tuple[_Leaf, int] | None:
        """Where pattern[lo:] ends in the tree: a node, (leaf, index in its sequence of the
        next token) when it ends inside a single occurrence, or None when it does not occur."""
        node = self.root
        hi = len(pattern)
        i = lo
        while i < hi:
            child = node.children.get(pattern[i])
            if child is None:
                return None
            i += 1
            if child.__class__ is _Leaf:
                seq = child.seq
                pos = child.pos + 1
                rest = hi - i
                if pos + rest > min(child.start + self.depth, len(seq)):
                    return None
                if seq[pos:pos + rest] != pattern[i:hi]:
                    return None
                return child, pos + rest
            node = child
        return node

    def leaf_tail(self, leaf: _Leaf, pos: int, budget: int) -> list[int]:
        """Up to `budget` tokens of a single occurrence from sequence index `pos` on."""
        return leaf.seq[pos:min(leaf.start + self.depth, len(leaf.seq), pos + budget)]

    def size(self) -> tuple[int, int]:
        """(real nodes, leaves), the root excluded: for tests and memory reports."""
        nodes = leaves = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                if child.__class__ is _Leaf:
                    leaves += 1
                else:
                    nodes += 1
                    stack.append(child)
        return nodes, leaves


class _RequestIndex:
    """A decoding request's own tree: its prompt and output so far."""

    __slots__ = ("tree", "seq", "active")

    def __init__(self, depth: int) -> None:
        self.tree = _SuffixTree(depth)
        self.seq: list[int] = []
        self.active: _Active = []

    def catch_up(self, token_ids: Sequence[int]) -> None:
        """Index the tokens added since the last call (all of them the first time, or when the
        sequence is shorter than what was indexed, which a growing request never is)."""
        if len(token_ids) < len(self.seq):
            self.tree = _SuffixTree(self.tree.depth)
            self.seq = []
            self.active = []
        if len(token_ids) > len(self.seq):
            self.active = self.tree.extend(self.seq, self.active, token_ids[len(self.seq):])


class SuffixProposer(TokenProposer):
    """Suffix decoding over the request's own tokens and recent requests' outputs.

    Each step: index the request's new tokens; for every tail length m (1 <= m < the tail
    window of max_tree_depth tokens) that occurs earlier, walk the most frequent continuation
    for up to min(max_tokens, floor(factor * m + offset)) tokens, keeping the walk with the
    highest score (sum of path probabilities; ties go to the longer match), over the
    request's tree first and then the global tree, which must score strictly higher to win.
    """

    name = "suffix"

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config or SuffixConfig()
        self._requests: dict[str, _RequestIndex] = {}
        self._global = _SuffixTree(self.config.max_tree_depth)
        self._cached: deque[list[int]] = deque()  # outputs in the global tree, oldest first

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                max_tokens: int) -> list[int]:
        return self.draft(request_id, token_ids, max_tokens).tokens

    def draft(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> SuffixDraft:
        """`propose`, with the score, match length and source of the answer."""
        index = self._requests.get(request_id)
        if index is None:
            index = self._requests[request_id] = _RequestIndex(self.config.max_tree_depth)
        index.catch_up(token_ids)
        if max_tokens <= 0:
            return SuffixDraft([])
        best = self._from_request(index, max_tokens)
        if self._cached:
            other = self._from_global(index.seq, max_tokens, best.score)
            if other.score > best.score + _TIE:
                best = other
        return best

    def request_finished(self, request_id: str, token_ids: Sequence[int],
                         num_prompt_tokens: int) -> None:
        self._requests.pop(request_id, None)
        output = list(token_ids[num_prompt_tokens:])
        limit = self.config.max_cached_requests
        if limit == 0 or not output:
            return
        while len(self._cached) >= limit:
            self._global.remove(self._cached.popleft())
        seq: list[int] = []
        self._global.extend(seq, [], output)
        self._cached.append(seq)

    # ---- introspection --------------------------------------------------------------------

    @property
    def num_cached_requests(self) -> int:
        return len(self._cached)

    def global_tree_size(self) -> tuple[int, int]:
        """(real nodes, leaves) of the global tree."""
        return self._global.size()

    def request_tree_size(self, request_id: str) -> tuple[int, int]:
        """(real nodes, leaves) of a live request's tree."""
        return self._requests[request_id].tree.size()

    # ---- search ---------------------------------------------------------------------------

    def _budget(self, match_len: int, max_tokens: int) -> int:
        """How many tokens a match of `match_len` may propose (the tree depth bounds it too:
        a path holds at most max_tree_depth tokens, match included)."""
        cfg = self.config
        by_match = int(match_len * cfg.max_spec_factor + cfg.max_spec_offset + _EPS)
        return min(max_tokens, by_match, cfg.max_tree_depth - match_len)

    def _from_request(self, index: _RequestIndex, max_tokens: int) -> SuffixDraft:
        """The request's active suffixes are exactly its tail's matches that occur earlier
        (the rest lie in their own leaf, with nothing after them), so no lookup is needed."""
        n = len(index.seq)
        window = min(n, self.config.max_tree_depth)
        min_prob = self.config.min_token_prob
        tree = index.tree
        best = SuffixDraft([])
        for start, node in index.active:  # longest match first
            match_len = n - start
            if match_len >= window:
                continue
            budget = self._budget(match_len, max_tokens)
            if budget <= best.score + _TIE:  # cannot beat the best (a tie goes to the longer match)
                continue
            tokens, score = tree.walk(node, match_len, budget, min_prob)
            if tokens and score > best.score + _TIE:
                best = SuffixDraft(tokens, score, match_len, "request")
        return best

    def _from_global(self, seq: list[int], max_tokens: int, to_beat: float) -> SuffixDraft:
        """Match the tail against the global tree, shortest first: a tail that does not occur
        has no longer tail that does, so the first miss ends the search."""
        n = len(seq)
        window = min(n, self.config.max_tree_depth)
        min_prob = self.config.min_token_prob
        tree = self._global
        best = SuffixDraft([], to_beat)
        for match_len in range(1, window):
            found = tree.match(seq, n - match_len)
            if found is None:
                break
            budget = self._budget(match_len, max_tokens)
            if budget <= 0 or budget < best.score - _TIE:  # a tie may still win: it is longer
                continue
            if isinstance(found, tuple):
                tokens = tree.leaf_tail(found[0], found[1], budget)
                score = float(len(tokens))
            else:
                tokens, score = tree.walk(found, match_len, budget, min_prob)
            if tokens and score >= best.score - _TIE:
                best = SuffixDraft(tokens, score, match_len, "global")
        return best
