"""Runners of the PD roles for ``python -m pdjax.serve --role prefill|decode|pd`` (DESIGN.md §4).

* ``prefill`` / ``decode``: one engine (its ``EngineCore`` builds the role's transfer manager)
  behind the HTTP API, plus ``GET /pd_state`` (rooms, peers, per-chunk transfer records).
* ``pd``: the one-machine demo. This process starts a prefill server and a decode server as
  child processes and runs the router in front of them on ``--host``/``--port``:

      router   --port P        (this process)
      prefill  --port P+1      bootstrap --disaggregation-bootstrap-port (default 8998)
      decode   --port P+2

  The children get every other flag of this command. They are started with
  ``PR_SET_PDEATHSIG`` (Linux), so they die with this process even when it is killed with
  SIGKILL; on SIGTERM this process stops them and waits. If a child exits, the router stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import os
import signal
import subprocess
import sys

from pdjax.config import ServerArgs
from pdjax.pd.frame_auth import SECRET_ENV

logger = logging.getLogger(__name__)

# CPU-friendly demo default: the pages-per-sequence buckets stop at 64 (45 forward shapes
# per server instead of 60 at 2048 tokens); pass --context-length to change it.
PD_DEMO_DEFAULTS = {"context_length": 1024}


def run_single_role(args: ServerArgs) -> int:
    """A prefill or decode server: the HTTP API over one engine, plus ``/pd_state``."""
    from aiohttp import web

    from pdjax.engine import AsyncEngine
    from pdjax.server.app import create_app, run_server

    engine = AsyncEngine(args, progress=not args.skip_warmup_progress)
    engine.start()       # the model loads while the app waits for the tokenizer
    app = create_app(engine, served_model_name=engine.served_model_name, api_key=args.api_key)

    async def pd_state(request: web.Request) -> web.Response:
        try:
            state = await asyncio.to_thread(engine.pd_state)
        except (RuntimeError, TimeoutError) as e:
            return web.json_response({"error": str(e)}, status=503)
        return web.json_response(state)

    app.router.add_get("/pd_state", pd_state)
    return run_server(app, args.host, args.port, on_shutdown=engine.shutdown,
                      drain_timeout_s=args.drain_timeout_s)


def child_argv(args: ServerArgs, role: str, port: int) -> list[str]:
    """``python -m pdjax.serve`` arguments that rebuild ``args`` with another role and port."""
    argv = [sys.executable, "-m", "pdjax.serve"]
    for f in ServerArgs.settings():
        value = getattr(args, f.name)
        # The secret travels in the environment (start_children), never on a command line.
        if f.name in ("role", "port", "disaggregation_secret") or value is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv + ["--role", role, "--port", str(port)]


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM this child when the parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def start_children(args: ServerArgs) -> tuple[list[subprocess.Popen], str, str]:
    """Start the prefill and decode servers; returns (processes, prefill URL, decode URL)."""
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    env = dict(os.environ)
    if args.disaggregation_secret:
        env[SECRET_ENV] = args.disaggregation_secret
    procs = []
    urls = []
    for offset, role in ((1, "prefill"), (2, "decode")):
        port = args.port + offset
        procs.append(subprocess.Popen(child_argv(args, role, port), env=env,
                                      preexec_fn=_die_with_parent))
        urls.append(f"http://{host}:{port}")
    return procs, urls[0], urls[1]


def stop_children(procs: list[subprocess.Popen], timeout_s: float = 30.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_pd(args: ServerArgs) -> int:
    """The one-machine PD deployment: prefill + decode children and the router in front."""
    from pdjax.router import PDRouter, serve_router

    overrides = {k: v for k, v in PD_DEMO_DEFAULTS.items()
                 if getattr(args, k) == ServerArgs.default(k)}
    if overrides:
        args = dataclasses.replace(args, **overrides)
    procs, prefill_url, decode_url = start_children(args)
    router = PDRouter([(prefill_url, args.disaggregation_bootstrap_port)], [decode_url])
    code = 0

    async def main() -> None:
        stop = asyncio.Event()

        async def watch() -> None:
            nonlocal code
            while not stop.is_set():
                for p in procs:
                    if p.poll() is not None:
                        logger.error("PD child %s exited with %s; stopping", p.args[-3], p.returncode)
                        code = 1
                        stop.set()
                        return
                await asyncio.sleep(1.0)

        watcher = asyncio.create_task(watch())
        try:
            await serve_router(router, args.host, args.port, stop_event=stop)
        finally:
            watcher.cancel()

    try:
        asyncio.run(main())
    finally:
        stop_children(procs)
    return code


RUNNERS = {"prefill": run_single_role, "decode": run_single_role, "pd": run_pd}
