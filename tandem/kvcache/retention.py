"""An LRU eviction order in which retained keys go last, until their deadline. Torch-free.

A client's prompt-caching breakpoint (`cache_control`, docs/prompt-caching.md) asks that the
prompt up to it stay cached for a TTL. Retention *orders* eviction, it never pins: a retained
key is handed out only when no ordinary key is left, so a queue that would have yielded a
victim without retention still yields one. After its deadline a key is ordinary again.

Two queues and a heap keep every operation O(1) or O(log n):

* `plain`: the LRU of ordinary keys (and of retained ones not yet at its head), head first;
* `_kept`: retained keys that reached the head of `plain` and were set aside, in the order
  they got there (so still least recent first);
* `_expiry`: a min-heap of deadlines, one live entry per retained key (`_scheduled` says
  which), read lazily. An entry never comes up after its key's deadline: a deadline extended
  after its entry was pushed is found when the entry comes up and pushed again; one set
  earlier than the live entry (the key's content was forgotten, then retained anew) gets an
  entry of its own, the old one going stale. A key whose retention ends goes back to the head
  of `plain` (it was older than everything there when it was set aside).

Deadlines may be set on keys that are not in the queue (a device block in use is retained
before it is freed); they take effect when the key is pushed. Used by the device block pool's
free queue (engine/block_pool.py) and the CPU tier's chunk LRU (connector/tiers.py).
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

Clock = Callable[[], float]


class RetainingLRU:
    def __init__(self, clock: Clock = time.monotonic) -> None:
        self.clock = clock
        # Public for hot paths (the block pool's, per block): `plain[key] = None` is `push`, and
        # while `until` is empty `plain.popitem(last=False)` is `pop`.
        self.plain: OrderedDict[int, None] = OrderedDict()
        self._kept: OrderedDict[int, None] = OrderedDict()
        # key -> retention deadline (clock time), in the queue or not. Read-only outside: callers
        # on a hot path test it for emptiness to skip the retention work when nothing is retained.
        self.until: dict[int, float] = {}
        self._expiry: list[tuple[float, int]] = []
        self._scheduled: dict[int, float] = {}  # key -> the deadline of its live entry in _expiry

    # --- membership -----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.plain) + len(self._kept)

    def __contains__(self, key: int) -> bool:
        return key in self.plain or key in self._kept

    def __iter__(self) -> Iterator[int]:
        """The keys in the order `pop` would hand them out now (for reports and tests)."""
        if self.until:
            self._expire(self.clock())
        until = self.until
        order = [k for k in self.plain if k not in until]
        order += self._kept
        order += [k for k in self.plain if k in until]
        return iter(order)

    def push(self, key: int) -> None:
        """Queue a key as the most recent one."""
        self.plain[key] = None

    def push_first(self, key: int) -> None:
        """Queue a key as the next to go (nothing in it is worth keeping)."""
        self.plain[key] = None
        self.plain.move_to_end(key, last=False)


    def touch(self, key: int) -> None:
        """A use of a queued key: it becomes the most recent."""
        if key in self._kept:
            del self._kept[key]
            self.plain[key] = None
        else:
            self.plain.move_to_end(key)

    def remove(self, key: int) -> None:
        """Take a key out of the queue (its retention, if any, stays with it). KeyError if absent."""
        if key in self.plain:
            del self.plain[key]
        else:
            del self._kept[key]

    def pop(self) -> int:
        """The next victim: the least recent ordinary key, else the least recent retained one.

        Its retention is not dropped here: the caller decides whether the key's content is
        gone (`forget`) or the key goes back. KeyError when the queue is empty."""
        plain = self.plain
        if self.until:
            self._expire(self.clock())
            until = self.until
            while plain:
                key, _ = plain.popitem(last=False)
                if key not in until:
                    return key
                self._kept[key] = None  # retained: set aside behind every ordinary key
            return self._kept.popitem(last=False)[0]
        return plain.popitem(last=False)[0]

    # --- retention ------------------------------------------------------------------
    def retain(self, key: int, until: float) -> None:
        """Keep `key` behind ordinary keys until clock time `until` (a later deadline extends)."""
        if until <= self.until.get(key, float("-inf")):
            return
        self.until[key] = until
        entry = self._scheduled.get(key)
        if entry is None or entry > until:
            self._scheduled[key] = until
            heapq.heappush(self._expiry, (until, key))
            if len(self._expiry) > 2 * len(self._scheduled) + 64:  # stale entries: rebuild
                self._expiry = [(deadline, k) for k, deadline in self._scheduled.items()]
                heapq.heapify(self._expiry)

    def forget(self, key: int) -> None:
        """The key's content is gone: it is no longer retained (and goes first if set aside)."""
        if self.until.pop(key, None) is not None and key in self._kept:
            self._demote(key)

    def is_retained(self, key: int) -> bool:
        deadline = self.until.get(key)
        return deadline is not None and deadline > self.clock()

    def num_retained(self) -> int:
        """Keys retained now, in the queue or not."""
        if self.until:
            self._expire(self.clock())
        return len(self.until)

    def _expire(self, now: float) -> None:
        heap, until, scheduled = self._expiry, self.until, self._scheduled
        while heap and heap[0][0] <= now:
            entry, key = heapq.heappop(heap)
            if scheduled.get(key) != entry:
                continue  # stale: the key has a newer entry
            del scheduled[key]
            deadline = until.get(key)
            if deadline is None:  # forgotten since
                continue
            if deadline > now:  # extended since
                scheduled[key] = deadline
                heapq.heappush(heap, (deadline, key))
            else:
                del until[key]
                if key in self._kept:
                    self._demote(key)

    def _demote(self, key: int) -> None:
        """A set-aside key is ordinary again: it goes to the head of the plain queue, since it
        was older than every key there when it was set aside."""
        del self._kept[key]
        self.plain[key] = None
        self.plain.move_to_end(key, last=False)
