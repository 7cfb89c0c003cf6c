"""``python -m pdjax.serve``: the server entry point for every role (DESIGN.md §1, §4).

    python -m pdjax.serve [--model-path PATH] [--host H] [--port P] [--role colocated|prefill|decode|pd] ...

Flags use SGLang's names (``--page-size``, ``--chunked-prefill-size``, ``--enable-mixed-chunk``,
``--disaggregation-mode``, ...); run with ``--help`` for the list. With no ``--model-path`` the
default SmolLM2 model is served. The HTTP server starts at once and answers ``/health`` with
503 until warm-up is done; SIGTERM drains and exits 0 (without the interpreter's teardown:
``exit_process``).
"""

from __future__ import annotations

import logging
import os
import sys

from pdjax.config import ServerArgs
from pdjax.config_fields import FlagParser


def parse_args(argv=None) -> ServerArgs:
    """``ServerArgs`` of ``argv`` with everything checked that can be before the model loads:
    each flag, the checkpoint's config, weight files and tokenizer, the output folders and
    ports, and (one host, not the ``pd`` launcher, whose children check themselves) the
    devices' count and memory (``settings.check_devices``). Any error is one line
    ``error: FIELD: ...`` on stderr and ``SystemExit(2)``."""
    parser = FlagParser(prog="python -m pdjax.serve", description=__doc__.splitlines()[0])
    ServerArgs.add_cli_args(parser)
    try:
        args = ServerArgs.from_cli_args(parser.parse_args(argv))
        from pdjax.engine import settings
        from pdjax.transfer.factory import check_kv_connector

        check_kv_connector(args.kv_connector)

        model_path, model_cfg = settings.check_checkpoint_paths(args)
        settings.check_serve_files(args, model_path)
        if args.nnodes == 1 and args.role != "pd":
            settings.check_local_devices(args, model_cfg)
        else:   # the devices are known after joining (multi-host) or in the children (pd)
            settings.check_devices(args, model_cfg, platform="", num_devices=None,
                                   device_bytes=None)
        if args.profile_dir is not None:
            from pdjax.paths import writable_folder

            writable_folder("profile_dir", args.profile_dir)
        if args.node_rank == 0:         # the HTTP server (and a prefill's bootstrap server)
            from pdjax.ports import check_listen_port

            check_listen_port("port", args.host, args.port)
            if args.role in ("prefill", "pd"):
                if args.role == "pd" and args.disaggregation_bootstrap_port == 0:
                    # a prefill alone may take any free port and say it in /get_server_info;
                    # the router of --role pd is given the port before the prefill starts
                    raise ValueError("disaggregation_bootstrap_port: --role pd tells its router "
                                     "the prefill's bootstrap port before it starts, so it "
                                     "must be a port (1-65535), not 0")
                if args.disaggregation_bootstrap_port == args.port:
                    raise ValueError(f"disaggregation_bootstrap_port: {args.port} is --port "
                                     "too; the HTTP and bootstrap servers need a port each")
                check_listen_port("disaggregation_bootstrap_port", args.host,
                                  args.disaggregation_bootstrap_port)
            if args.role == "pd" and args.port:
                _check_pd_child_ports(args, check_listen_port)
        return args
    except ValueError as e:
        parser.error(str(e))


def _check_pd_child_ports(args: ServerArgs, check_listen_port) -> None:
    """``--role pd`` runs its prefill on ``--port + 1`` and its decode on ``--port + 2``:
    ``ValueError`` naming ``port`` when either is past 65535, is the bootstrap port, or cannot
    be listened on (they failed in the children, exit 1, after the router had started)."""
    for offset, child in ((1, "prefill"), (2, "decode")):
        port = args.port + offset
        why = (f"{port} is past 65535" if port > 65535 else
               "it is --disaggregation-bootstrap-port" if port == args.disaggregation_bootstrap_port
               else None)
        if why is not None:
            raise ValueError(f"port: --role pd runs its {child} server on --port + {offset}, and "
                             f"{why}")
        try:
            check_listen_port("port", args.host, port)
        except ValueError as e:
            raise ValueError(f"{e} (--role pd runs its {child} server on --port + {offset})") \
                from None


def run_colocated(args: ServerArgs) -> int:
    """One engine behind the HTTP API; the prefill and decode roles build on the same pieces."""
    from pdjax.engine import AsyncEngine
    from pdjax.server.app import create_app, run_server

    engine = AsyncEngine(args, progress=not args.skip_warmup_progress)
    engine.start()       # the model loads while the app waits for the tokenizer
    app = create_app(engine, served_model_name=engine.served_model_name, api_key=args.api_key)
    return run_server(app, args.host, args.port, on_shutdown=engine.shutdown,
                      drain_timeout_s=args.drain_timeout_s)


def _role_runner(role: str):
    if role == "colocated":
        return run_colocated
    from pdjax.entrypoints import pd_roles     # PD roles: prefill, decode, pd

    return pd_roles.RUNNERS[role]


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.node_rank > 0:          # multi-host follower: no HTTP (pdjax.distributed)
        from pdjax.entrypoints.multihost import run_follower

        return run_follower(args)
    return _role_runner(args.role)(args)


def exit_process(code: int):
    """Leave with ``code`` without the interpreter's teardown. By the time a role's runner
    returns, its own shutdown is done (requests drained, the engine thread joined, the
    background compile stopped); what the teardown would add is garbage-collecting XLA's
    executables and buffers, 4.8 s for the tiny test model on this CPU (a faulthandler dump
    2 s after SIGTERM found only the main thread, "Garbage-collecting"), which every SIGTERM
    and every test that stops a server waited for. Logging and the standard streams are
    flushed first, and a multi-host process leaves ``jax.distributed`` first (its peers wait
    for that)."""
    jax = sys.modules.get("jax")
    if jax is not None and jax.distributed.is_initialized():
        try:
            jax.distributed.shutdown()
        except Exception:          # a peer already gone: the exit code still stands
            logging.getLogger(__name__).exception("leaving jax.distributed failed")
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_process(main())
