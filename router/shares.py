"""Each tenant's share of a model's recent arrivals: how the admission queue tells a heavy
tenant (:mod:`router.admission`).

Every arrival is weighed ``_inc`` when counted, and ``_inc`` grows by
``1 / (1 - 1/window)`` an arrival, so the shares decay exponentially over about
``window`` arrivals without touching every tenant on every arrival.
"""

from __future__ import annotations


class Shares:
    def __init__(self, window: int) -> None:
        self.window = window
        self.recent: dict[str, float] = {}
        self.total = 0.0
        self.counted = 0
        self._inc = 1.0

    def count(self, key: str) -> None:
        """One count for ``key``: a request arriving from that tenant."""
        self._inc /= 1.0 - 1.0 / self.window
        if self._inc > 1e200:  # rescale long before floats overflow
            self.recent = {b: v / self._inc for b, v in self.recent.items()}
            self.total /= self._inc
            self._inc = 1.0
        self.recent[key] = self.recent.get(key, 0.0) + self._inc
        self.total += self._inc
        self.counted += 1

    def of(self, key: str) -> float:
        return self.recent.get(key, 0.0)

    def active(self, weight: float) -> int:
        """How many keys hold at least ``weight`` of one count made now (0.5: about one count within
        the last ``0.7 × window``); keys under 1% of one are forgotten, so the map stays small."""
        floor = 0.01 * self._inc
        for key in [k for k, v in self.recent.items() if v < floor]:
            self.total -= self.recent.pop(key)
        return sum(1 for v in self.recent.values() if v >= weight * self._inc)
