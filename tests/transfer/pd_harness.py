"""Real PD processes for the end-to-end tests (and ``scripts/bench_faults.py``): servers, HTTP
helpers, independent arithmetic.

Every server is a ``python -m pdjax.serve`` child on 127.0.0.1 with one XLA thread; its log
goes to a file that a failing test prints. ``TINY_ARGS`` is the configuration every process
uses (the colocated reference engine in the test process too), so they share compiled
executables through the persistent compilation cache.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from pdjax.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE_SIZE = 4
CHUNK = 32
TINY_ARGS = dict(page_size=PAGE_SIZE, max_total_tokens=2048, chunked_prefill_size=CHUNK,
                 max_running_requests=8, context_length=256)
EOS = 2

_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(XLA_FLAGS="--xla_cpu_multi_thread_eigen=false", OMP_NUM_THREADS="1",
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1")
    env.update(extra)
    return env


class Server:
    """One ``python -m pdjax.serve`` (or any module) child process with a log file."""

    def __init__(self, name: str, argv: list[str], port: int, log_dir: str,
                 env: dict[str, str] | None = None):
        self.name, self.argv, self.port = name, argv, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.env = env or child_env()
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=ROOT, start_new_session=True)
        log.close()

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            status, _ = get(self.url + "/health", timeout_s=2)
            if status == 200:
                return
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not healthy in {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def pd_server(name: str, role: str, model_path: str, log_dir: str, *, port: int | None = None,
              bootstrap_port: int | None = None, extra: list[str] = (),
              env: dict[str, str] | None = None, hooks: list[str] = (), **overrides) -> Server:
    """A PD server child; ``hooks``: ``pd_child.py`` test hooks (``--shuffle-free-pages N``,
    ``--corrupt-backend``), which run the server through that launcher."""
    port = port or free_port()
    args = dict(TINY_ARGS, **overrides)
    launcher = ["-m", "pdjax.serve"]
    if hooks:
        launcher = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "pd_child.py"),
                    *hooks, "--"]
    argv = [sys.executable, *launcher, "--role", role, "--model-path", model_path,
            "--port", str(port), "--skip-warmup-progress", "--num-reserved-decode-tokens", "16"]
    for k, v in args.items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    if bootstrap_port is not None:
        argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    server = Server(name, argv + list(extra), port, log_dir, env)
    server.bootstrap_port = bootstrap_port
    return server


def pd_router(name: str, prefill: Server, bootstrap_port: int, decode: Server,
              log_dir: str) -> Server:
    """A ``python -m pdjax.router`` child in front of one prefill and one decode."""
    port = free_port()
    return Server(name, [sys.executable, "-m", "pdjax.router", "--prefill", prefill.url,
                         str(bootstrap_port), "--decode", decode.url, "--port", str(port)],
                  port, log_dir, child_env())


@contextlib.contextmanager
def prefill_decode_router(model_path: str, log_dir: str, *, decode_name: str = "decode",
                          prefill_extra: list[str] = (), decode_extra: list[str] = (),
                          **overrides):
    """One prefill, one decode and a router in front of them, ``running`` for the block;
    yields ``dict(prefill=, decode=, router=, bport=)``. ``overrides`` go to both servers."""
    bport = free_port()
    prefill = pd_server("prefill", "prefill", model_path, log_dir, bootstrap_port=bport,
                        extra=prefill_extra, **overrides)
    decode = pd_server(decode_name, "decode", model_path, log_dir, extra=decode_extra,
                       **overrides)
    router = pd_router("router", prefill, bport, decode, log_dir)
    with running([prefill, decode, router]):
        yield dict(prefill=prefill, decode=decode, router=router, bport=bport)


@contextlib.contextmanager
def running(servers: list[Server]):
    """Wait until every server answers ``/health``, and stop them all (last started first) when
    the block ends; a server that fails to start gets every log printed."""
    try:
        for s in servers:
            s.wait_healthy()
        yield
    except BaseException:
        for s in servers:
            print(f"==== {s.name} log ====\n{s.log_tail(80)}")
        raise
    finally:
        for s in reversed(servers):
            s.stop()


# ---------------------------------------------------------------------------------------------
# HTTP


def _decode(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def get(url: str, timeout_s: float = 30.0):
    try:
        with _opener.open(url, timeout=timeout_s) as r:
            return r.status, _decode(r.read())
    except urllib.error.HTTPError as e:
        return e.code, _decode(e.read())
    except OSError as e:
        return 0, str(e)


def post(url: str, body, timeout_s: float = 60.0):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with _opener.open(req, timeout=timeout_s) as r:
            return r.status, _decode(r.read())
    except urllib.error.HTTPError as e:
        return e.code, _decode(e.read())


def generate(server: Server, ids: list[int], sampling_params: dict, **extra) -> dict:
    """``/generate`` of ``ids`` on ``server`` (a router or a colocated server); asserts 200."""
    status, out = post(server.url + "/generate", {"input_ids": ids,
                                                  "sampling_params": sampling_params, **extra})
    assert status == 200, out
    return out


def post_stream(url: str, body, timeout_s: float = 60.0) -> tuple[int, list]:
    """POST with ``stream: true``; returns (status, [decoded ``data:`` events], [DONE] dropped)."""
    req = urllib.request.Request(url, data=json.dumps(dict(body, stream=True)).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    try:
        with _opener.open(req, timeout=timeout_s) as r:
            events = []
            for line in r:
                line = line.strip()
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    events.append(json.loads(line[6:]))
            return r.status, events
    except urllib.error.HTTPError as e:
        return e.code, [_decode(e.read())]


def pd_body(ids: list[int], room: int, bootstrap_port: int, **sampling) -> dict:
    """A /generate body as a PD router would send it."""
    sp = {"temperature": 0, "max_new_tokens": 8}
    sp.update(sampling)
    return {"input_ids": ids, "sampling_params": sp, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": bootstrap_port, "bootstrap_room": room}


def pd_pair(prefill, decode, bport, ids, room, max_new, stream=False):
    """What a router does: the same body with bootstrap fields to both, the decode answers."""
    body = pd_body(ids, room, bport, max_new_tokens=max_new)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p = pool.submit(post, prefill.url + "/generate", body)
        if stream:
            status, events = post_stream(decode.url + "/generate", body)
            assert status == 200 and events and not any(e.get("error") for e in events), events
            out = events[-1]
        else:
            status, out = post(decode.url + "/generate", body)
            assert status == 200, out
        assert p.result()[0] == 200, p.result()
    return out


def wait_until(pred, timeout_s: float, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


def load(server: Server) -> dict:
    status, body = get(server.url + "/get_load")
    assert status == 200, body
    return body


def pd_state(server: Server) -> dict:
    status, body = get(server.url + "/pd_state")
    assert status == 200, body
    return body


def at_baseline(server: Server) -> bool:
    """No page held by anything but the evictable prefix cache, no PD request in flight."""
    ld = load(server)
    return (ld["num_pinned_pages"] == 0 and ld["num_pd_rooms"] == 0
            and ld["num_running_reqs"] == 0 and ld.get("num_quarantined_pages", 0) == 0
            and ld.get("num_held_reqs", 0) == 0)


def metric_value(text: str, name: str, **labels) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (Prometheus text)."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, rest = head.partition("{")
        if metric != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += float(value)
            found = True
    assert found, f"metric {name} {labels} not exposed"
    return total


# ---------------------------------------------------------------------------------------------
# Independent arithmetic (not pdjax's own code)


def count_runs(src: list[int], dst: list[int]) -> int:
    """Runs of pages consecutive in both lists, by a plain loop."""
    runs = 0
    for i in range(len(src)):
        if i == 0 or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            runs += 1
    return runs


def greedy_agrees(ref_ids: list[int], ref_top: list, got_ids: list[int], tie: float = 1e-3) -> int:
    """Check ``got_ids`` against a greedy reference (DESIGN.md §5): equal up to the first
    position where the reference's top-2 logprob gap is below ``tie``; returns the number of
    positions compared. ``ref_top[i]`` holds ``(logprob, token, text)`` entries, best first."""
    assert len(got_ids) == len(ref_ids), (got_ids, ref_ids)
    for i, (a, b) in enumerate(zip(ref_ids, got_ids)):
        gap = ref_top[i][0][0] - ref_top[i][1][0]
        if a != b:
            assert gap < tie, f"token {i}: got {b}, reference {a} (top-2 gap {gap:.2e})\n" \
                              f"got {got_ids}\nref {ref_ids}"
            return i
        if gap < tie:
            return i + 1
    return len(ref_ids)


def speculation_agrees(server: Server, ids: list[int], sampling_params: dict) -> tuple[dict, dict]:
    """Generate greedy ``ids`` on ``server`` opting out of speculation, then speculating: the
    tokens agree tie-aware (``greedy_agrees``). Returns the plain and the speculative output."""
    ref = generate(server, ids, {**sampling_params, "speculative": False}, return_logprob=True,
                   top_logprobs_num=2)
    out = generate(server, ids, sampling_params)
    greedy_agrees(ref["output_ids"], ref["meta_info"]["output_top_logprobs"], out["output_ids"])
    return ref, out


@contextlib.contextmanager
def fp8_kv_pd(model_path: str, log_dir: str, **args):
    """A PD pair with ``--kv-cache-dtype fp8_e4m3`` behind a router, a bfloat16-KV decode
    beside it (its pairing must be refused) and the colocated fp8 engine of the same settings,
    for the block; yields ``dict(prefill=, decode=, decode_bf16=, router=, colocated=,
    model=, bport=)``. ``args`` go to every server and the engine."""
    from pdjax.engine import Engine

    colocated = Engine(model_path=model_path, progress=False, kv_cache_dtype="fp8_e4m3", **args)
    bport = free_port()
    prefill = pd_server("prefill", "prefill", model_path, log_dir, bootstrap_port=bport,
                        kv_cache_dtype="fp8_e4m3", **args)
    decode = pd_server("decode", "decode", model_path, log_dir, kv_cache_dtype="fp8_e4m3",
                       **args)
    decode_bf16 = pd_server("decode_bf16", "decode", model_path, log_dir,
                            kv_cache_dtype="bfloat16", **args)
    router = pd_router("router", prefill, bport, decode, log_dir)
    try:
        with running([prefill, decode, decode_bf16, router]):
            yield dict(prefill=prefill, decode=decode, decode_bf16=decode_bf16, router=router,
                       colocated=colocated, model=model_path, bport=bport)
    finally:
        colocated.shutdown()
