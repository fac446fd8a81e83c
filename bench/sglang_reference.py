"""A pure-Python reimplementation of SGLang's NGRAM corpus (``sglang.srt.speculative.cpp_ngram``:
``trie.cpp``, ``result.cpp``, ``param.h``), the peer the SGLang drop-in is measured against.

It follows SGLang's C++ step by step, with SGLang's server defaults:
- ``batch_put(windows)``: every suffix of every window is inserted into one trie, at most
  ``max_trie_depth`` (18) tokens deep; a child seen again gets ``freq += 1`` and moves to the
  front of its parent's recency list (so re-sending overlapping windows counts insert events).
- ``batch_get(req_ids, windows, total_lens)``: the stateful matcher keeps, per request, the trie
  node of each suffix of length 1..18 ending at its last token (advanced by the tokens appended
  since the previous call, rebuilt from the window otherwise); the anchors with children seed the
  tree, deepest first.
- BFS (``buildRecency``): from each anchor a breadth-first walk takes the most recently used
  children, ``(17 - depth) * scale + min_bfs_breadth`` of them at the first level and ``scale``
  fewer per level, ``scale = (max_bfs_breadth - min_bfs_breadth) / 17``.
- PROB (``buildFrequency``): a max-heap of path probabilities, each node's ``max_bfs_breadth``
  most frequent children with their frequency share.
- Output: K = ``draft_token_num`` tokens per request (the last token, then K - 1 nodes in
  breadth-first order, padded with token 0 under the root) and a K x K ancestor mask.

Differences, none of which changes what is drafted on the replayed traces: heap ties in PROB are
broken by insertion order (``std::priority_queue`` leaves them to the implementation); the trie's
node pool does not evict (SGLang evicts least recently used leaves at ``capacity`` nodes; exceeding
it here is a ``RuntimeError`` naming the count, and the replay reports the peak).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence

import numpy as np


class _Node:
    __slots__ = ("token", "children", "freq", "stamp")

    def __init__(self, token: int, stamp: int) -> None:
        self.token = token
        self.children: dict[int, _Node] | None = None
        self.freq = 1
        self.stamp = stamp  # last insert that passed through it: the parent's recency order


class _MatchState:
    __slots__ = ("epoch", "processed", "anchors")

    def __init__(self) -> None:
        self.epoch = 0
        self.processed = 0
        self.anchors: list[_Node | None] = []


class SGLangNgramReference:
    """SGLang's ``NgramCorpus`` (the trie corpus) with its calling conventions."""

    def __init__(self, draft_token_num: int = 12, match_type: str = "BFS", *, max_trie_depth: int = 18,
                 min_bfs_breadth: int = 1, max_bfs_breadth: int = 10, capacity: int = 10_000_000) -> None:
        if match_type not in ("BFS", "PROB"):
            raise ValueError(f"match_type: expected 'BFS' or 'PROB', got {match_type!r}")
        if draft_token_num < 2:
            raise ValueError(f"draft_token_num: expected an int >= 2 (the root and a node), got {draft_token_num!r}")
        if not 1 <= min_bfs_breadth <= max_bfs_breadth:
            raise ValueError(f"bfs breadth: expected 1 <= min <= max, got {min_bfs_breadth}, {max_bfs_breadth}")
        if max_trie_depth < 1:
            raise ValueError(f"max_trie_depth: expected an int >= 1, got {max_trie_depth!r}")
        self.k = draft_token_num
        self.match_type = match_type
        self.depth = max_trie_depth
        self.min_breadth, self.max_breadth = min_bfs_breadth, max_bfs_breadth
        self.capacity = capacity
        self.reset()

    def reset(self) -> None:
        self.root = _Node(-1, 0)
        self.nodes = 0
        self.clock = 0
        self.epoch = getattr(self, "epoch", 0) + 1
        self.states: dict[str, _MatchState] = {}

    # ------------------------------------------------------------------ inserts (Trie::insert)

    def batch_put(self, batch_tokens: Sequence[Sequence[int]]) -> None:
        for seq in batch_tokens:
            self._insert(list(seq))

    def synchronize(self) -> None:
        """Inserts apply at once here (SGLang's insert thread is drained by ``synchronize``)."""

    def _insert(self, tokens: list[int]) -> None:
        n = len(tokens)
        for i in range(n):
            self.clock += 1
            cursor = self.root
            for t in tokens[i:i + self.depth]:
                kids = cursor.children
                if kids is None:
                    kids = cursor.children = {}
                child = kids.get(t)
                if child is None:
                    if self.nodes >= self.capacity:
                        raise RuntimeError(f"trie holds {self.nodes} nodes, its capacity: the reference does not evict")
                    child = kids[t] = _Node(t, self.clock)
                    self.nodes += 1
                else:
                    child.freq += 1
                    child.stamp = self.clock
                cursor = child

    # ------------------------------------------------------------------ matching (Trie::match)

    def _child(self, node: _Node | None, t: int) -> _Node | None:
        if node is None or node.children is None:
            return None
        return node.children.get(t)

    def _rebuild(self, ctx: list[int], st: _MatchState, total: int) -> None:
        st.epoch, st.processed = self.epoch, total
        st.anchors = []
        for d in range(1, min(len(ctx), self.depth) + 1):
            node: _Node | None = self.root
            for t in ctx[len(ctx) - d:]:
                node = self._child(node, t)
                if node is None:
                    break
            st.anchors.append(node)

    def _advance(self, st: _MatchState, tokens: list[int], total: int) -> None:
        for t in tokens:
            nxt = [self._child(self.root, t)]
            for d in range(1, min(len(st.anchors) + 1, self.depth)):
                nxt.append(self._child(st.anchors[d - 1], t))
            st.anchors = nxt
        st.processed = total

    def _anchors(self, ctx: list[int], st: _MatchState, total: int) -> list[tuple[_Node, int]]:
        forward = total >= st.processed
        appended = total - st.processed if forward else 0
        # A new state (epoch 0) or one from before a reset is rebuilt, as SGLang's is.
        if (st.epoch == self.epoch and forward and appended <= len(ctx)
                and len(st.anchors) == min(st.processed, self.depth)):
            self._advance(st, ctx[len(ctx) - appended:], total)
        else:
            self._rebuild(ctx, st, total)
        return [(st.anchors[d - 1], d) for d in range(len(st.anchors), 0, -1)
                if st.anchors[d - 1] is not None and st.anchors[d - 1].children]

    # ------------------------------------------------------------------ trees

    def _recency(self, anchors: list[tuple[_Node, int]], n: int) -> list[dict[int, int]]:
        tree: list[dict[int, int]] = [{}]
        max_match_depth = max(1, self.depth - 1)
        scale = (self.max_breadth - self.min_breadth) / max_match_depth
        cursor = 1
        for node, depth in anchors:
            queue = deque([(0, (max_match_depth - depth) * scale + self.min_breadth, node)])
            while queue and cursor <= n:
                parent, breadth_f, tnode = queue.popleft()
                breadth = max(1, int(breadth_f))
                kids = heapq.nlargest(breadth, tnode.children.values(), key=_stamp) if tnode.children else []
                for child in kids:
                    if cursor > n:
                        break
                    pos = tree[parent].get(child.token)
                    if pos is None:
                        pos = tree[parent][child.token] = cursor
                        tree.append({})
                        cursor += 1
                    queue.append((pos, breadth_f - scale, child))
        return tree

    def _frequency(self, anchors: list[tuple[_Node, int]], n: int) -> list[dict[int, int]]:
        tree: list[dict[int, int]] = [{}]
        heap: list[tuple[float, int, int, _Node]] = []
        order = 0
        cursor = 1

        def add(parent: int, tnode: _Node, prob: float) -> None:
            nonlocal order
            if not tnode.children:
                return
            top = heapq.nsmallest(self.max_breadth, tnode.children.values(), key=_by_freq)
            total = float(sum(c.freq for c in top)) or 1.0
            for c in top:
                order += 1
                heapq.heappush(heap, (-(c.freq / total * prob), order, parent, c))

        for node, _ in anchors:
            add(0, node, 1.0)
            while heap and cursor <= n:
                neg_prob, _, parent, tnode = heapq.heappop(heap)
                pos = tree[parent].get(tnode.token)
                if pos is None:
                    pos = tree[parent][tnode.token] = cursor
                    tree.append({})
                    cursor += 1
                add(pos, tnode, -neg_prob)  # as SGLang: also below a node that merged into an earlier one
        return tree

    def batch_get(self, req_ids: Sequence[object], batch_tokens: Sequence[Sequence[int]],
                  total_lens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        if not (len(req_ids) == len(batch_tokens) == len(total_lens)):
            raise ValueError("batch_get: req_ids, batch_tokens and total_lens must have one entry per request")
        k = self.k
        drafts = np.zeros(len(req_ids) * k, dtype=np.int64)
        mask = np.zeros(len(req_ids) * k * k, dtype=np.int64)
        for i, (rid, window, total) in enumerate(zip(req_ids, batch_tokens, total_lens)):
            ctx = list(window)
            if not ctx:
                raise ValueError(f"batch_get: request {rid!r} has an empty token window")
            st = self.states.setdefault(str(rid), _MatchState())
            anchors = self._anchors(ctx, st, int(total))
            tree = self._recency(anchors, k - 1) if self.match_type == "BFS" else self._frequency(anchors, k - 1)
            tok, m = _fill(ctx[-1], k, tree)
            drafts[i * k:(i + 1) * k] = tok
            mask[i * k * k:(i + 1) * k * k] = m.ravel()
        return drafts, mask

    def erase_match_state(self, req_ids: Sequence[object]) -> None:
        for rid in req_ids:
            self.states.pop(str(rid), None)


def _stamp(node: _Node) -> int:
    return node.stamp


def _by_freq(node: _Node) -> tuple[int, int]:
    """SGLang's ``sorted_children`` order: more frequent first, then the smaller token."""
    return (-node.freq, node.token)


def _fill(last: int, k: int, tree: list[dict[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """result.cpp ``fillResult``: breadth-first order from the root, zero padding, ancestor mask."""
    tokens, prevs = [last], [-1]
    queue = deque((t, nxt, 0) for t, nxt in tree[0].items())
    while queue:
        t, nxt, prev = queue.popleft()
        tokens.append(t)
        prevs.append(prev)
        me = len(tokens) - 1
        queue.extend((t2, n2, me) for t2, n2 in tree[nxt].items())
    while len(tokens) < k:
        tokens.append(0)
        prevs.append(0)
    mask = np.zeros((k, k), dtype=np.int64)
    for i in range(k):
        if prevs[i] != -1:
            mask[i, :prevs[i] + 1] = mask[prevs[i], :prevs[i] + 1]
        mask[i, i] = 1
    return np.asarray(tokens[:k], dtype=np.int64), mask
