"""A step-load shape for the locustfile: users added step by step until TTFT p90 crosses an SLO.

    locust -f loadtest/locustfile.py,loadtest/locust_step.py --host http://127.0.0.1:8080 --headless \\
        --slo-ttft-p90-ms 2000 --step-users 4 --step-time 20 --max-users 64 --step-log out/steps.jsonl \\
        MultiTurnChatUser

Locust runs a ``LoadTestShape`` whenever a loaded file defines one, so the shape lives in a
file of its own: a fixed-user run leaves it out. The decisions (when a step ends, whether it
met the SLO, the req/s sustained) are :class:`loadtest.capacity.StepRamp`'s; this file only
feeds it Locust's ``TTFT`` events and hands its user counts to Locust. Each finished step is
appended to ``--step-log`` as one JSON line, so a ramp cut short still leaves its steps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from locust import LoadTestShape, events  # first: Locust monkey-patches ssl

from loadtest.capacity import Step, StepRamp

_STATE: dict[str, Any] = {"ramp": None, "shape": None}


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    parser.add_argument("--slo-ttft-p90-ms", type=float, default=2000.0, help="stop once a step's TTFT p90 is over this")
    parser.add_argument("--step-users", type=int, default=4, help="users added at each step")
    parser.add_argument("--step-time", type=float, default=20.0, help="seconds each step lasts")
    parser.add_argument("--max-users", type=int, default=64, help="the ramp's last step")
    parser.add_argument("--step-log", default="", help="append each finished step here as a JSON line")


@events.request.add_listener
def _on_request(request_type: str, response_time: float, exception: Any = None, **_: Any) -> None:
    """Each request fires one ``TTFT`` event (:mod:`loadtest.locustfile`); a failed one carries its exception."""
    ramp = _STATE["ramp"]
    if ramp is not None and request_type == "TTFT":
        ramp.observe(_STATE["shape"].get_run_time(), None if exception else response_time)


class StepToSLO(LoadTestShape):
    """``k x --step-users`` users during step k, after half a step of warm-up at the first step's
    users, until :class:`StepRamp` says the ramp is over."""

    def tick(self) -> tuple[int, float] | None:
        ramp = _STATE["ramp"]
        if ramp is None:
            opts = self.runner.environment.parsed_options
            log = Path(opts.step_log) if opts.step_log else None
            ramp = _STATE["ramp"] = StepRamp(opts.slo_ttft_p90_ms, opts.step_users, opts.step_time, opts.max_users,
                                              warmup_s=opts.step_time / 2, on_step=lambda s: _log_step(log, s))
            _STATE["shape"] = self
        users = ramp.users_at(self.get_run_time())
        return None if users is None else (users, float(max(ramp.step_users, 1)))


def _log_step(path: Path | None, step: Step) -> None:
    if path is not None:
        with open(path, "a") as fh:
            fh.write(json.dumps(step.as_dict()) + "\n")
