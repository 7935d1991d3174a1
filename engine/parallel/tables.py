"""Block tables to the other ranks as deltas: each step's descriptor names each row's table by a key and carries
only the block ids appended since the last step, so its size is O(batch), not O(blocks in the batch).

The ranks also keep one list per table (`TableMirror`): the same list object step after step is what lets a rank's
DeviceBlockTable write only the new entries, as rank 0's does. Freshly unpickled lists would be new objects every
step, and every row would be rewritten.

A request's `block_ids` list only grows while it runs; the BlockManager replaces it (trim, preemption, finish), never
shrinks it in place. So a list object seen before needs only its tail since then, and a new list object gets a new
key and is sent whole."""

from __future__ import annotations

from dataclasses import dataclass, field

# a table absent this long is dropped on both sides; a running request that the token budget skips for a few steps
# keeps its key, so its table is not sent whole again when it comes back
KEEP_STEPS = 8


@dataclass(frozen=True)
class TableDelta:
    keys: list[int]  # [B] each row's table
    grown: dict[int, list[int]]  # key -> block ids appended since it was last sent (a new key: its whole table)
    dropped: list[int] = field(default_factory=list)  # keys the sender forgot: the rank forgets them too


class TableSender:
    """Rank 0: which table each key names and how much of it the ranks have."""

    def __init__(self, keep_steps: int = KEEP_STEPS):
        self.keep_steps = keep_steps
        # id(list) -> [the list, its key, entries sent, last step seen]; holding the list keeps its id from being
        # reused by another list while the entry lives
        self._known: dict[int, list] = {}
        self._next_key = 0
        self._step = 0

    def delta(self, tables: list[list[int]]) -> TableDelta:
        self._step += 1
        keys, grown, dropped = [], {}, []
        for ids in tables:
            entry = self._known.get(id(ids))
            if entry is not None and len(ids) < entry[2]:  # cut in place, against the rule above: sent whole again
                dropped.append(entry[1])
                entry = None
            if entry is None:
                entry = self._known[id(ids)] = [ids, self._next_key, 0, 0]
                self._next_key += 1
            if len(ids) > entry[2]:
                grown[entry[1]] = ids[entry[2] :]
                entry[2] = len(ids)
            entry[3] = self._step
            keys.append(entry[1])
        for i in [i for i, e in self._known.items() if self._step - e[3] > self.keep_steps]:
            dropped.append(self._known.pop(i)[1])
        return TableDelta(keys, grown, dropped)


class TableMirror:
    """Another rank: one list per key, extended in place, so a row's list is the same object step after step."""

    def __init__(self):
        self._tables: dict[int, list[int]] = {}

    def tables(self, delta: TableDelta) -> list[list[int]]:
        for key in delta.dropped:
            self._tables.pop(key, None)
        for key, tail in delta.grown.items():
            self._tables.setdefault(key, []).extend(tail)
        return [self._tables[k] for k in delta.keys]
