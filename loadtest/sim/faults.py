"""Fault injection for one simulated engine (tests of the router's failure handling).

Set at start (``--fault-*`` flags, applied to every instance) or live with
``POST /debug/fault`` on the instance (a JSON body with any of the fields below);
``GET /debug/fault`` shows the current state.

* ``drop_event_fraction``: share of KV-event messages the PUB socket silently drops.
  A dropped message still takes a seq and stays in the replay buffer, like a message
  lost to a slow subscriber, so the gap is visible and repairable by replay.
* ``error_rate``: share of generation requests answered 500 (OpenAI-shaped).
* ``extra_latency_s``: wall seconds added before a generation request is admitted.
* ``pause_s``: the engine freezes for that long (no steps, HTTP requests hang), like
  a stalled process.
* ``down_s``: the instance dies: HTTP and ZMQ sockets close, in-flight requests are
  cut, the cache is lost. After ``down_s`` seconds it restarts empty (seq from 0, a
  restart the subscriber must notice); ``null`` or ``-1`` keeps it down for good.
"""

from __future__ import annotations

import random
import time

from pydantic import BaseModel, ConfigDict, Field


class FaultUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    drop_event_fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    error_rate: float | None = Field(default=None, ge=0.0, le=1.0)
    extra_latency_s: float | None = Field(default=None, ge=0.0)
    pause_s: float | None = Field(default=None, ge=0.0)
    down_s: float | None = None


class Faults:
    def __init__(self, drop_event_fraction: float = 0.0, error_rate: float = 0.0, extra_latency_s: float = 0.0, seed: int | None = None) -> None:
        self.drop_event_fraction = drop_event_fraction
        self.error_rate = error_rate
        self.extra_latency_s = extra_latency_s
        self.paused_until = 0.0
        self._rng = random.Random(seed)

    def drop_event(self) -> bool:
        return self.drop_event_fraction > 0 and self._rng.random() < self.drop_event_fraction

    def inject_error(self) -> bool:
        return self.error_rate > 0 and self._rng.random() < self.error_rate

    def pause_left(self) -> float:
        return max(0.0, self.paused_until - time.monotonic())

    def apply(self, update: FaultUpdate) -> None:
        if update.drop_event_fraction is not None:
            self.drop_event_fraction = update.drop_event_fraction
        if update.error_rate is not None:
            self.error_rate = update.error_rate
        if update.extra_latency_s is not None:
            self.extra_latency_s = update.extra_latency_s
        if update.pause_s is not None:
            self.paused_until = time.monotonic() + update.pause_s

    def state(self) -> dict[str, float]:
        return {
            "drop_event_fraction": self.drop_event_fraction,
            "error_rate": self.error_rate,
            "extra_latency_s": self.extra_latency_s,
            "pause_left_s": self.pause_left(),
        }
