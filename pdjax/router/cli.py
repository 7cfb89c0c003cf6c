"""``python -m pdjax.router``'s arguments (sglang-router's PD mode) and ``main``."""

from __future__ import annotations

import argparse
import asyncio
import logging

from pdjax.config_fields import FlagParser
from pdjax.router.handlers import serve_router
from pdjax.router.pd_router import PDRouter
from pdjax.router.pool import POLICIES


def parse_prefill_args(values: list[list[str]]) -> list[tuple[str, int | None]]:
    """``--prefill URL [BOOTSTRAP_PORT]`` occurrences -> ``[(url, port or None)]``.
    Raises ``ValueError`` for a bad port or extra values."""
    out = []
    for v in values:
        if not 1 <= len(v) <= 2:
            raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT], got {v}")
        port = None
        if len(v) == 2 and v[1].lower() not in ("none", "null"):
            try:
                port = int(v[1])
            except ValueError:
                raise ValueError(f"--prefill {v[0]}: bootstrap port {v[1]!r} is not an "
                                 f"integer") from None
            if not 1 <= port <= 65535:
                raise ValueError(f"--prefill {v[0]}: bootstrap port {port} outside [1, 65535]")
        out.append((v[0], port))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="python -m pdjax.router",
                   description="a minimal PD router (sglang-router's PD arguments)")
    p.add_argument("--prefill", nargs="+", action="append", required=True,
                   metavar=("URL", "BOOTSTRAP_PORT"), help="a prefill server and its bootstrap port")
    p.add_argument("--decode", action="append", required=True, metavar="URL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--pd-disaggregation", action="store_true",
                   help="accepted for sglang-router compatibility (always on)")
    p.add_argument("--request-timeout-secs", type=float, default=3600.0)
    p.add_argument("--policy", choices=POLICIES, default="load_aware",
                   help="worker choice: fewest outstanding requests, ties by KV usage from "
                        "/get_load (load_aware), or round_robin")
    p.add_argument("--load-poll-interval-secs", type=float, default=1.0,
                   help="how often /get_load of every worker is read (load_aware)")
    p.add_argument("--log-level", default="info")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        router = PDRouter(parse_prefill_args(ns.prefill), ns.decode, ns.request_timeout_secs,
                          policy=ns.policy, load_poll_interval_s=ns.load_poll_interval_secs)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=ns.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve_router(router, ns.host, ns.port))
    return 0

