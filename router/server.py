"""``kvrouter serve --config FILE [--port P] [--policy NAME]``: run the router.

uvicorn with uvloop and httptools (the fastest event loop and HTTP parser it offers),
one process; access logs are off because they cost more than routing a short request.

The GIL switch interval is lowered from 5 ms to 0.5 ms: the KV-event subscriber and the
tokenizer pool are CPU-bound threads, and with the default interval the event loop can
wait up to 5 ms for the GIL after each of its awaits, which shows up directly as
routing latency. The cost is a little more switching on the background threads.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import get_args

import uvicorn

from router.config import ConfigError, PolicyName, load_config

SWITCH_INTERVAL_S = 0.0005


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="fleet config (YAML)")
    parser.add_argument("--host", default=None, help="override router.host")
    parser.add_argument("--port", type=int, default=None, help="override router.port")
    parser.add_argument("--policy", choices=get_args(PolicyName), default=None, help="override router.policy for every model")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    if args.port is not None:
        config.router.port = args.port
    if args.host is not None:
        config.router.host = args.host
    if args.policy is not None:
        config.router.policy = args.policy
        for m in config.models:
            m.policy = None
    from router.app import create_app

    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # One prompt per encode call: rayon's pool adds threads (and scheduling) and no speed,
    # and it would run deferred tokenization outside the lowered-priority thread.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    try:
        app = create_app(config)
    except (ValueError, OSError) as e:
        print(f"{args.config}: {e}", file=sys.stderr)
        return 2
    uvicorn.run(
        app,
        host=config.router.host,
        port=config.router.port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level=args.log_level,
        proxy_headers=False,  # nothing reads the client address; skips a header scan per request
        timeout_keep_alive=30,
        backlog=4096,
    )
    return 0
