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

Before the trees, optionally (`prompt_lookup`, on in the engine's default config), prompt
lookup: the longest tail (`lookup_min` to `max_tree_depth` tokens) that occurred earlier in
the request itself proposes what followed its earliest occurrence (tandem/spec/ngram.py), as
many tokens as the same rule allows a tree's match (floor(factor * m + offset)). An agent's
edit copies a block of its context, and a copy goes on where its source goes on, which the
trees' answer often is not: their most frequent continuation of a tail that occurs in several
places, an earlier request's similar answer out-scoring the request's own text in the global
tree, and no proposal past `max_tree_depth` tokens of match and proposal together. The trees
answer when the request has no such match (prose, a first mention). Replayed over the
default model's greedy answers (tandem/bench/spec_replay.py) to code edits it was not chosen
on, lookup first takes 4-7% fewer verification steps at k = 4-16 and wastes fewer guesses
(0.4-0.9 rejected per step against 0.7-1.0); tool calls and prose change by 1% or less.

A tree counts, for every substring of length <= `max_tree_depth` of its sequences, how many
times it occurs; a continuation's estimated probability is the product of
`child.count / node.count` along its path (Arctic's estimate). The plain trie of those
substrings holds depth x tokens nodes (~200k for an 8k prompt, tens of MB as Python objects),
so it is compressed the way a suffix tree is: a node is an edge of several tokens that share one
count, cut only where the path branches or an occurrence ends, and the single-occurrence rest
of a path is a `_Leaf`, a reference into the sequence that holds it, that grows by itself as
a live request's sequence grows. Only suffixes of the request's tail that occur earlier need
work per new token, and the answers are exactly those of the plain trie.

Pure Python and torch-free: it runs in the engine core once per decoding request per step.
A call with one new token costs about 35 us at 8k tokens of context, 95 us with prompt lookup
(its byte searches scan the whole context; 2-core EPYC, against a 45 ms step).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tandem.spec.ngram import NgramProposer
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
    prompt_lookup: try prompt lookup over the request's own tokens first (a tandem
        extension, off here so that the defaults are Arctic's algorithm; the engine's
        SpeculativeConfig turns it on): the longest tail of lookup_min..max_tree_depth tokens
        seen earlier proposes what followed its earliest occurrence, with the same length
        rule as a tree's match.
    """

    max_tree_depth: int = 24
    max_cached_requests: int = 10000
    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1
    prompt_lookup: bool = False
    lookup_min: int = 2

    def __post_init__(self) -> None:
        if self.max_tree_depth < 2:
            raise ValueError(f"max_tree_depth must be >= 2, got {self.max_tree_depth}")
        if self.max_cached_requests < 0:
            raise ValueError(f"max_cached_requests must be >= 0, got {self.max_cached_requests}")
        if self.max_spec_factor < 0:
            raise ValueError(f"max_spec_factor must be >= 0, got {self.max_spec_factor}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {self.min_token_prob}")
        if not isinstance(self.prompt_lookup, bool):
            raise ValueError(f"prompt_lookup must be true or false, got {self.prompt_lookup!r}")
        if not 1 <= self.lookup_min <= self.max_tree_depth:
            raise ValueError(f"lookup_min must be in 1..max_tree_depth ({self.max_tree_depth}), "
                             f"got {self.lookup_min}")


@dataclass(frozen=True)
class SuffixDraft:
    """A proposal and why: `score` is the sum of its tokens' path probabilities (its expected
    accepted length under the tree's estimate; a lookup's tokens count 1 each), `match_len`
    the tail length it continues, `source` "lookup" (prompt lookup over the request's
    tokens), "request" (its tree) or "global" ("" for no proposal)."""

    tokens: list[int]
    score: float = 0.0
    match_len: int = 0
    source: str = ""


class _Node:
    """An edge: `length` tokens that every occurrence passing through takes together (same
    `count`), stored as wseq[wpos : wpos + length] of the newest occurrence. Under FIFO
    eviction the newest occurrence is the last to go, so the reference stays valid for the
    node's whole life, and it is the occurrence left when eviction brings a count back to 1.

    `best` caches the most frequent child, so a proposal walks down in O(1) per edge. Ties go
    to the child whose latest occurrence is newest (the most recently seen continuation).
    None with children present means "stale after an eviction": recomputed when next read.
    The root is a node of length 0 whose count is the number of indexed tokens."""

    __slots__ = ("count", "children", "best", "length", "wseq", "wpos")

    def __init__(self, count: int, length: int, wseq: list[int] | None, wpos: int) -> None:
        self.count = count
        self.children: dict[int, _Node | _Leaf] = {}
        self.best: _Node | _Leaf | None = None
        self.length = length
        self.wseq = wseq
        self.wpos = wpos


class _Leaf:
    """The single-occurrence rest of a path: seq[pos : min(start + depth, len(seq))], part of
    the suffix of `seq` that starts at `start`. The end is not stored because it moves: while
    `seq` is a live request's token list, the leaf grows with it."""

    __slots__ = ("seq", "start", "pos")
    count = 1

    def __init__(self, seq: list[int], start: int, pos: int) -> None:
        self.seq = seq
        self.start = start
        self.pos = pos


# The suffixes of a sequence being extended whose path ends at a real node (always at the
# node's last token): (start of the suffix in the sequence, node). Suffixes whose path
# occurs only once live in their own leaf and need no entry. Sorted by start.
_Active = list[tuple[int, _Node]]
# A place in a tree: a node or leaf, and the index in its sequence of the next token on its
# edge (the edge's end when the place is the node's end).
_Place = tuple[_Node | _Leaf, int]


class _SuffixTree:
    """Occurrence counts of all substrings of length <= depth of some token sequences."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node(0, 0, None, 0)
        # Insertion rank of each indexed sequence (by id): orders occurrences across
        # sequences when a stale `best` is recomputed.
        self.rank: dict[int, int] = {}
        self._next_rank = 0

    # ---- building -------------------------------------------------------------------------

    def extend(self, seq: list[int], active: _Active, tokens: Sequence[int]) -> _Active:
        """Append `tokens` to `seq` and index them. For each token, every active suffix (and a
        new one at the root) moves one token down; longest first, which keeps the entries not
        yet processed valid when an edge is cut or fused."""
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
                if child is None:  # a new continuation: this suffix is now unique
                    leaf = leaf_cls(seq, start, pos)
                    children[tok] = leaf
                    best = node.best
                    if len(children) == 1 or (best is not None and best.count == 1):
                        node.best = leaf
                elif node is not root and len(children) == 1 and node.count == child.count + 1:
                    # Only this suffix ended here and all others go on into `child`, which
                    # this one now follows too: the node's edge takes the child's first token.
                    self._absorb(node, child, seq, pos)
                    moved.append((start, node))
                elif child.__class__ is leaf_cls:
                    moved.append((start, self._split_leaf(node, tok, child, seq, pos)))
                elif child.length == 1:
                    count = child.count + 1
                    child.count = count
                    child.wseq = seq
                    child.wpos = pos
                    best = node.best
                    if best is not None and count >= best.count:
                        node.best = child
                    moved.append((start, child))
                else:
                    moved.append((start, self._split_node(node, tok, child, seq, pos)))
            active = moved
        return active

    def _absorb(self, node: _Node, child: _Node | _Leaf, seq: list[int], pos: int) -> None:
        """Move the child's first token into the node's edge (the child disappears when that
        was all of it); the node's count already includes the suffix now passing through."""
        node.wseq = seq
        node.wpos = pos - node.length
        node.length += 1
        if child.__class__ is _Leaf:
            lseq = child.seq
            nxt = child.pos + 1
            if nxt < min(child.start + self.depth, len(lseq)):
                child.pos = nxt
                node.children = {lseq[nxt]: child}
            else:
                node.children = {}
                child = None
        elif child.length == 1:
            node.children = child.children
            child = child.best
        else:
            child.wpos += 1
            child.length -= 1
            node.children = {child.wseq[child.wpos]: child}
        node.best = child

    def _split_leaf(self, node: _Node, tok: int, leaf: _Leaf, seq: list[int],
                    pos: int) -> _Node:
        """A second occurrence reaches the leaf's first token: that token becomes a real node
        of count 2, the leaf keeps the rest (if the other occurrence goes on)."""
        real = _Node(2, 1, seq, pos)
        lseq = leaf.seq
        nxt = leaf.pos + 1
        if nxt < min(leaf.start + self.depth, len(lseq)):
            leaf.pos = nxt
            real.children[lseq[nxt]] = leaf
            real.best = leaf
        node.children[tok] = real
        best = node.best
        if best is leaf or (best is not None and best.count <= 2):
            node.best = real
        return real

    @staticmethod
    def _split_node(node: _Node, tok: int, child: _Node, seq: list[int], pos: int) -> _Node:
        """The suffix enters a longer edge and stops after its first token: cut the edge there
        (the first token has one more occurrence than the rest)."""
        head = _Node(child.count + 1, 1, seq, pos)
        child.wpos += 1
        child.length -= 1
        head.children[child.wseq[child.wpos]] = child
        head.best = child
        node.children[tok] = head
        best = node.best
        if best is child or (best is not None and best.count <= head.count):
            node.best = head
        return head

    # ---- eviction -------------------------------------------------------------------------

    def remove(self, seq: list[int]) -> None:
        """Subtract every suffix of `seq`, which must be the oldest sequence in the tree, so
        that the tree is again exactly the tree of the other sequences."""
        del self.rank[id(seq)]
        for start in range(len(seq)):
            self._remove_suffix(seq, start)

    def _remove_suffix(self, seq: list[int], start: int) -> None:
        """Decrement the counts along the suffix's path, drop what falls to 0, then restore the
        compressed shape: a node back to one occurrence becomes a leaf, and a node left with
        one child of its own count absorbs that child."""
        root = self.root
        root.count -= 1
        end = min(start + self.depth, len(seq))
        path: list[tuple[_Node, int, _Node, int]] = []  # (parent, token, node, depth above)
        node = root
        i = start
        while i < end:
            tok = seq[i]
            child = node.children[tok]
            if child.__class__ is not _Leaf:
                child.count -= 1
            if child.__class__ is _Leaf or child.count == 0:  # the rest was this suffix only
                del node.children[tok]
                if node.best is child:
                    node.best = None
                break
            if node.best is child:
                node.best = None  # it may no longer be the most frequent
            path.append((node, tok, child, i - start))
            i += child.length
            node = child
        for parent, tok, real, above in path:
            if real.count == 1:  # the topmost node of a single occurrence: a leaf again
                parent.children[tok] = _Leaf(real.wseq, real.wpos - above, real.wpos)
                if parent.best is real:
                    parent.best = None
                return
        # Only the deepest node lost a child or an ending occurrence without its child
        # losing one too, so only it can have become a chain link.
        if path:
            last = path[-1][2]
            if len(last.children) == 1:
                child = next(iter(last.children.values()))
                if child.count == last.count:  # a real node: `last` has count >= 2
                    last.length += child.length
                    last.children = child.children
                    last.best = child.best

    # ---- proposing ------------------------------------------------------------------------

    def best_child(self, node: _Node) -> _Node | _Leaf | None:
        """The most frequent child, recomputed when an eviction left the cache stale, with the
        cache's tie rule: the newest latest occurrence wins."""
        best = node.best
        if best is None and node.children:
            rank = self.rank
            top: tuple[int, int, int] | None = None
            for child in node.children.values():
                if child.__class__ is _Leaf:
                    key = (1, rank[id(child.seq)], child.pos)
                else:
                    key = (child.count, rank[id(child.wseq)], child.wpos)
                if top is None or key > top:
                    best, top = child, key
            node.best = best
        return best

    def edge_end(self, obj: _Node | _Leaf) -> tuple[list[int], int, int]:
        """(sequence, index of the first token, index past the last) of an edge."""
        if obj.__class__ is _Leaf:
            seq = obj.seq
            return seq, obj.pos, min(obj.start + self.depth, len(seq))
        return obj.wseq, obj.wpos, obj.wpos + obj.length

    def walk(self, place: _Place, budget: int, min_prob: float) -> tuple[list[int], float]:
        """Greedy continuation from `place`: the rest of its edge, then the most frequent child
        each step while the path's estimated probability stays >= min_prob. Returns the
        tokens and the sum of their path probabilities."""
        obj, nxt = place
        seq, _, end = self.edge_end(obj)
        tokens = seq[nxt:min(end, nxt + budget)]  # within an edge the probability stays 1
        score = float(len(tokens))
        if obj.__class__ is _Leaf:
            return tokens, score
        depth = self.depth
        node = obj
        prob = 1.0
        while len(tokens) < budget:
            child = node.best
            if child is None:
                child = self.best_child(node)
                if child is None:
                    break
            prob *= child.count / node.count
            if prob < min_prob:
                break
            room = budget - len(tokens)
            if child.__class__ is _Leaf:
                seq = child.seq
                first = child.pos
                end = min(child.start + depth, len(seq), first + room)
                tokens += seq[first:end]
                score += prob * (end - first)
                break
            first = child.wpos
            end = first + min(child.length, room)
            tokens += child.wseq[first:end]
            score += prob * (end - first)
            node = child
        return tokens, score

    def match(self, pattern: list[int], lo: int) -> _Place | None:
        """Where pattern[lo:] (non-empty) ends, or None when it does not occur. Compares
        whole edges at once, so its cost is the number of edges, not of tokens."""
        node = self.root
        hi = len(pattern)
        i = lo
        while True:
            child = node.children.get(pattern[i])
            if child is None:
                return None
            if child.__class__ is _Leaf:
                seq = child.seq
                first = child.pos
                n = min(hi - i, child.start + self.depth - first, len(seq) - first)
                if n < hi - i or seq[first:first + n] != pattern[i:hi]:
                    return None
                return child, first + n
            first = child.wpos
            n = hi - i
            if n <= child.length:
                if child.wseq[first:first + n] != pattern[i:hi]:
                    return None
                return child, first + n
            n = child.length
            if n > 1 and child.wseq[first:first + n] != pattern[i:i + n]:
                return None
            i += n
            node = child

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
    """What a decoding request keeps between steps: its own tree and its active suffixes."""

    __slots__ = ("tree", "seq", "active")

    def __init__(self, depth: int) -> None:
        self.tree = _SuffixTree(depth)
        self.seq: list[int] = []
        self.active: _Active = []

    def catch_up(self, token_ids: Sequence[int]) -> None:
        """Index the tokens added since the last call: all of them the first time, or again
        from scratch if the sequence got shorter (a decoding request's never does)."""
        if len(token_ids) < len(self.seq):
            self.tree = _SuffixTree(self.tree.depth)
            self.seq = []
            self.active = []
        if len(token_ids) > len(self.seq):
            self.active = self.tree.extend(self.seq, self.active, token_ids[len(self.seq):])


class SuffixProposer(TokenProposer):
    """Suffix decoding over the request's own tokens and recent requests' outputs.

    Each step: index the request's new tokens; with `prompt_lookup`, propose what followed
    the earliest earlier occurrence of the longest tail of m = lookup_min..max_tree_depth
    tokens, if any, for up to min(max_tokens, floor(factor * m + offset)) tokens; otherwise,
    for every tail length m (1 <= m < the tail
    window of max_tree_depth tokens) that occurs earlier, walk the most frequent continuation
    for up to min(max_tokens, floor(factor * m + offset)) tokens, keeping the walk with the
    highest score (sum of path probabilities; ties go to the longer match), over the
    request's tree and then the global tree, which must score strictly higher to win.
    """

    name = "suffix"

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config or SuffixConfig()
        self._requests: dict[str, _RequestIndex] = {}
        self._global = _SuffixTree(self.config.max_tree_depth)
        self._cached: deque[list[int]] = deque()  # outputs in the global tree, oldest first
        self._orders: dict[tuple[int, int], list[tuple[int, int]]] = {}
        cfg = self.config
        self._lookup = NgramProposer(cfg.lookup_min, cfg.max_tree_depth) if cfg.prompt_lookup else None

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                max_tokens: int) -> list[int]:
        return self._search(request_id, token_ids, max_tokens)[0]

    def draft(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> SuffixDraft:
        """`propose`, with the score, match length and source of the answer."""
        return SuffixDraft(*self._search(request_id, token_ids, max_tokens))

    def request_finished(self, request_id: str, token_ids: Sequence[int],
                         num_prompt_tokens: int) -> None:
        self._requests.pop(request_id, None)
        if self._lookup is not None:
            self._lookup.request_finished(request_id, token_ids, num_prompt_tokens)
        output = token_ids[num_prompt_tokens:]
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

    def _search(self, request_id: str, token_ids: Sequence[int],
                max_tokens: int) -> tuple[list[int], float, int, str]:
        """Index the new tokens, then prompt lookup (if on and it matches) or the best walk over
        the request's tree and, if it scores strictly higher, over the global tree: (tokens,
        score, match length, source)."""
        index = self._requests.get(request_id)
        if index is None:
            index = self._requests[request_id] = _RequestIndex(self.config.max_tree_depth)
        index.catch_up(token_ids)
        if self._lookup is not None and max_tokens > 0:
            cfg = self.config
            match_len, tokens = self._lookup.lookup(request_id, token_ids, max_tokens)
            del tokens[max(int(match_len * cfg.max_spec_factor + cfg.max_spec_offset + _EPS), 0):]
            if tokens:
                return tokens, float(len(tokens)), match_len, "lookup"
        n = len(index.seq)
        window = min(n, self.config.max_tree_depth)
        if max_tokens <= 0 or window < 2:
            return [], 0.0, 0, ""
        order = self._order(max_tokens, window)
        places: list[_Place | None] = [None] * window  # by match length
        for start, node in index.active:
            if n - start < window:
                places[n - start] = (node, node.wpos + node.length)
        best = self._best_walk(index.tree, places.__getitem__, order, ([], 0.0, 0, ""),
                               "request")
        if self._cached:
            # The global tree must beat the request's own strictly: a tie never goes to it.
            to_beat = (best[0], best[1], window, best[3])
            place_at = self._global_matcher(index.seq, window)
            other = self._best_walk(self._global, place_at, order, to_beat, "global")
            if other[3] == "global":
                best = other
        return best

    def _order(self, max_tokens: int, window: int) -> list[tuple[int, int]]:
        """(match length, token budget) for 1 <= m < window with a budget, most promising
        first: budget descending, then longer matches (which win ties). The budget is
        min(max_tokens, floor(factor * m + offset), max_tree_depth - m), the last because a
        path holds at most max_tree_depth tokens, match included. Cached per argument pair."""
        key = (max_tokens, window)
        order = self._orders.get(key)
        if order is None:
            cfg = self.config
            order = []
            for m in range(1, window):
                by_match = int(m * cfg.max_spec_factor + cfg.max_spec_offset + _EPS)
                budget = min(max_tokens, by_match, cfg.max_tree_depth - m)
                if budget > 0:
                    order.append((m, budget))
            order.sort(key=lambda mb: (mb[1], mb[0]), reverse=True)
            self._orders[key] = order
        return order

    def _best_walk(self, tree: _SuffixTree, place_at: Callable[[int], _Place | None],
                   order: list[tuple[int, int]], best: tuple[list[int], float, int, str],
                   source: str) -> tuple[list[int], float, int, str]:
        """The highest-scoring walk from the places that exist, ties to the longer match;
        `best` is the answer to beat. A place whose budget (its best possible score) cannot
        win is not walked; none after the first whose budget falls short can either."""
        min_prob = self.config.min_token_prob
        _, best_score, best_len, _ = best
        for match_len, budget in order:
            if budget < best_score - _TIE:
                break
            if budget <= best_score + _TIE and match_len < best_len:
                continue
            place = place_at(match_len)
            if place is None:
                continue
            tokens, score = tree.walk(place, budget, min_prob)
            if tokens and (score > best_score + _TIE
                           or (score >= best_score - _TIE and match_len > best_len)):
                best = (tokens, score, match_len, source)
                best_score = score
                best_len = match_len
        return best

    def _global_matcher(self, seq: list[int], window: int) -> Callable[[int], _Place | None]:
        """Where the tail of each length ends in the global tree, matched from the root on
        demand: a proposal usually needs only one or two lengths, and finished requests
        change the tree between steps, so nothing is kept. The longest tail that occurs is
        found first by bisection (a tail that does not occur has no longer one that does), so
        that no length is matched only to learn that it is absent."""
        tree = self._global
        n = len(seq)
        found: dict[int, _Place] = {}
        lo, hi = 0, window - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            place = tree.match(seq, n - mid)
            if place is None:
                hi = mid - 1
            else:
                found[mid] = place
                lo = mid
        longest = lo

        def place_at(match_len: int) -> _Place | None:
            if match_len > longest:
                return None
            place = found.get(match_len)
            return place if place is not None else tree.match(seq, n - match_len)

        return place_at
