#!/usr/bin/env python
"""Load and faults through the PD router: 2 prefill + 2 decode servers on 127.0.0.1, a mixed
workload at a fixed concurrency, while one prefill and one decode server are killed with
SIGKILL and restarted.

    python scripts/bench_faults.py                                  # tiny model, 500 x 64
    python scripts/bench_faults.py --num-requests 40 --concurrency 8 --kill-rounds 1
    python scripts/bench_faults.py --model-path DIR --output-file faults.json

Workload (seeded): prompts of 4-200 random token ids (a quarter share a 40-token prefix),
greedy `/generate` whole and streamed, streams the client drops after two chunks (aborts),
and `json_schema` structured outputs. Every greedy answer is compared with a colocated run of
the same prompts (an in-process ``Engine`` before the servers start; a difference where the
reference's top-2 logprobs are within 1e-3 is a tie, not an error).

Each request ends as one of:
  ok        200 and the colocated answer (or a valid structured output), or an abort the
            client asked for;
  failed    an HTTP error or an SSE error event with a message (a clear error);
  lost      no answer in ``--request-timeout-s``, a dropped connection, a stream that ends
            without a finish, or a wrong answer.

Faults: ``--kill-rounds`` times (at evenly spaced points of the run), prefill 0 and decode 0
get SIGKILL, stay down ``--down-s`` seconds and restart on the same ports. After the load the
script waits for every server to go idle and reads ``/get_load``: a page held by nothing but
the evictable prefix cache, a PD room, a metadata slot, a quarantined page, a held request or
a bound room is a leak (DESIGN.md §4 "Pages back to baseline"). TTFT and ITL (p50/p99) come
from the streams that ended ok. The run is bounded: ``--deadline-s`` stops sending new
requests. Exit status 0 only with 0 lost, 0 wrong and 0 leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "transfer"))

from bench_common import machine_info, now_iso, summarize_ms, write_json  # noqa: E402
# The tests' PD servers, in their tiny configuration (TINY_ARGS): shared compiled executables.
from pd_harness import TINY_ARGS, Server, child_env, pd_server  # noqa: E402

SCHEMA = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]},
                                           "ok": {"type": "boolean"}},
          "required": ["unit", "ok"], "additionalProperties": False}
LEAK_KEYS = ("num_pinned_pages", "num_pd_rooms", "num_metadata_slots_used",
             "num_quarantined_pages", "num_held_reqs", "num_bound_rooms", "num_running_reqs")
TIE = 1e-3
STARTUP_TIMEOUT_S = 600.0       # a server's start (or restart) until /health answers 200
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# ---------------------------------------------------------------------------------------------
# HTTP

def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, object]:
    """``(status, JSON body or None)``; status 0 when the server cannot be reached."""
    try:
        with _opener.open(url, timeout=timeout_s) as r:
            raw = r.read()
            try:
                return r.status, json.loads(raw)
            except ValueError:
                return r.status, None
    except urllib.error.HTTPError as e:
        return e.code, None
    except OSError:
        return 0, None


def http_post(url: str, body: dict, timeout_s: float = 30.0) -> tuple[int, object]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with _opener.open(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None
    except (OSError, ValueError):
        return 0, None


# ---------------------------------------------------------------------------------------------
# Workload

@dataclasses.dataclass
class Job:
    index: int
    kind: str                  # greedy | stream | abort | json
    ids: list[int]
    max_new: int
    ref_ids: list[int] | None = None
    ref_top: list | None = None
    outcome: str = ""          # ok | failed | lost
    detail: str = ""
    ttft_s: float | None = None
    end_s: float | None = None     # when it ended, on the run's clock (time.monotonic)
    itl_s: list[float] = dataclasses.field(default_factory=list)


def make_jobs(n: int, max_new: int, vocab_hi: int, seed: int) -> list[Job]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab_hi) for _ in range(40)]
    kinds = ["greedy"] * 4 + ["stream"] * 3 + ["abort"] + ["json"] * 2
    jobs = []
    for i in range(n):
        length = rng.choice([4, 5, 8, 9, 31, 33, 60, 120, 200])
        ids = [rng.randrange(3, vocab_hi) for _ in range(length)]
        if rng.random() < 0.25:
            ids = (shared + ids)[:200]
        jobs.append(Job(i, rng.choice(kinds), ids, rng.choice([1, 2, max_new])))
    return jobs


def sampling(job: Job) -> dict:
    sp = {"temperature": 0, "max_new_tokens": job.max_new}
    if job.kind == "json":
        sp.update(json_schema=json.dumps(SCHEMA), max_new_tokens=40)
    return sp


def reference(model: str, jobs: list[Job]) -> None:
    """The colocated answers of every non-abort job (greedy), with top-2 logprobs for ties."""
    from pdjax.engine import Engine

    todo = [j for j in jobs if j.kind != "abort"]
    engine = Engine(model_path=model, progress=False, **TINY_ARGS)
    try:
        for k in range(0, len(todo), 64):
            part = todo[k:k + 64]
            outs = engine.generate(input_ids=[j.ids for j in part],
                                   sampling_params=[sampling(j) for j in part],
                                   return_logprob=True, top_logprobs_num=2)
            for j, o in zip(part, outs):
                j.ref_ids = list(o["output_ids"])
                j.ref_top = o["meta_info"]["output_top_logprobs"]
    finally:
        engine.shutdown()


def agrees(job: Job, got: list[int]) -> bool:
    """``got`` equals the colocated answer up to its first near-tie (top-2 gap < ``TIE``)."""
    ref, top = job.ref_ids, job.ref_top
    for i, want in enumerate(ref):
        gap = top[i][0][0] - top[i][1][0] if len(top[i]) > 1 else 1.0
        if i >= len(got) or got[i] != want:
            return gap < TIE
        if gap < TIE:
            return True
    return len(got) == len(ref)


def judge(job: Job, out: dict) -> None:
    got = list(out.get("output_ids") or [])
    if job.kind == "json":
        fin = (out.get("meta_info") or {}).get("finish_reason") or {}
        if fin.get("type") == "stop":
            try:
                obj = json.loads(out.get("text", ""))
                if not (isinstance(obj, dict) and set(obj) == {"unit", "ok"}):
                    raise ValueError(obj)
            except ValueError as e:
                job.outcome, job.detail = "lost", f"wrong: invalid structured output ({e})"
                return
    if agrees(job, got):
        job.outcome = "ok"
    else:
        job.outcome, job.detail = "lost", f"wrong: got {got}, colocated {job.ref_ids}"


async def run_job(session, router: str, job: Job, timeout_s: float) -> None:
    import aiohttp

    body = {"input_ids": job.ids, "sampling_params": sampling(job)}
    stream = job.kind in ("stream", "abort")
    if stream:
        body["stream"] = True
    t0 = time.perf_counter()
    try:
        async with session.post(router + "/generate", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                raw = await resp.read()
                try:
                    msg = json.loads(raw)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    msg = raw.decode(errors="replace")[:200]
                job.outcome = "failed" if msg else "lost"
                job.detail = f"{resp.status}: {msg}"[:300]
                return
            if not stream:
                judge(job, await resp.json())
                return
            last, last_t, chunks = None, None, 0
            async for line in resp.content:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    err = ev["error"]
                    msg = err.get("message") if isinstance(err, dict) else str(err)
                    job.outcome = "failed" if msg else "lost"
                    job.detail = f"stream error: {msg}"[:300]
                    return
                now = time.perf_counter()
                if last_t is None:
                    job.ttft_s = now - t0
                else:
                    n_new = len(ev.get("output_ids") or []) - len(last.get("output_ids") or [])
                    if n_new > 0:
                        job.itl_s.extend([(now - last_t) / n_new] * n_new)
                last, last_t = ev, now
                chunks += 1
                if job.kind == "abort" and chunks >= 2:
                    job.outcome, job.detail = "ok", "aborted by the client"
                    return                      # leaving the block drops the connection
            if last is None or not (last.get("meta_info") or {}).get("finish_reason"):
                if job.kind == "abort":
                    job.outcome, job.detail = "ok", "finished before the abort"
                    return
                job.outcome, job.detail = "lost", "stream ended without a finish"
                return
            if job.kind == "abort":
                job.outcome, job.detail = "ok", "finished before the abort"
                return
            judge(job, last)
    except asyncio.TimeoutError:
        job.outcome, job.detail = "lost", f"no answer within {timeout_s} s"
    except (aiohttp.ClientError, OSError, ValueError) as e:
        job.outcome, job.detail = "lost", f"{type(e).__name__}: {e}"[:300]


def fault_plan(num_requests: int, rounds: int, concurrency: int) -> tuple[list[int], list[int]]:
    """``(marks, gates)``: round ``r`` kills after ``marks[r]`` requests are done; before it,
    requests ``[0, gates[r])`` may start, and ``gates[r + 1]`` once it restarted (the last
    gate is every request). A gate holds back all but ``concurrency`` requests past the mark,
    so the round happens before the load ends however fast the servers answer."""
    marks = [num_requests * (r + 1) // (rounds + 1) for r in range(rounds)]
    gates = [min(m + concurrency, num_requests) for m in marks] + [num_requests]
    return marks, gates


async def run_load(router: str, jobs: list[Job], concurrency: int, timeout_s: float,
                   deadline_s: float, faults) -> dict:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    done = [0]
    # Jobs from gate[0] on wait for the next fault round to be over, so that every round
    # happens under load however fast the load runs.
    gate = [0]                 # opened by the fault task
    t_end = time.monotonic() + deadline_s
    changed = asyncio.Event()

    async def one(session, job):
        while job.index >= gate[0]:
            changed.clear()
            await changed.wait()
        async with sem:
            if time.monotonic() > t_end:
                job.outcome, job.detail = "not_sent", "run deadline"
                return
            await run_job(session, router, job, timeout_s)
            job.end_s = time.monotonic()
            done[0] += 1

    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:
        def open_gate(index: int) -> None:
            gate[0] = index
            changed.set()

        fault_task = asyncio.create_task(faults(done, open_gate))
        t0 = time.perf_counter()
        await asyncio.gather(*(one(session, j) for j in jobs))
        wall = time.perf_counter() - t0
        fault_log = await fault_task
    return {"wall_s": wall, "faults": fault_log}


# ---------------------------------------------------------------------------------------------
# Baseline

def leaks(server: Server) -> dict:
    """What ``server`` holds beyond its evictable prefix cache (``{}``: at baseline)."""
    status, ld = http_get(server.url + "/get_load")
    if status != 200 or not isinstance(ld, dict):
        return {"get_load": status}
    out = {k: ld[k] for k in LEAK_KEYS if ld.get(k)}
    held = ld["num_total_pages"] - ld["num_free_pages"] - ld.get("num_evictable_pages", 0)
    if held:
        out["pages_held"] = held
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None,
                   help="checkpoint (default: the tests' tiny Llama, made if missing)")
    p.add_argument("--num-requests", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--kill-rounds", type=int, default=2,
                   help="times prefill 0 and decode 0 are killed with SIGKILL and restarted")
    p.add_argument("--down-s", type=float, default=3.0, help="how long a killed server stays down")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--request-timeout-s", type=float, default=180.0)
    p.add_argument("--deadline-s", type=float, default=1200.0,
                   help="no request is sent after this many seconds of load")
    p.add_argument("--idle-timeout-s", type=float, default=60.0,
                   help="how long the servers may take to return every page after the load")
    p.add_argument("--seed", type=int, default=32)
    p.add_argument("--transfer-backend", default="mooncake",
                   help="the PD servers' --disaggregation-transfer-backend (mooncake, jax)")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--output-file", default=None)
    args = p.parse_args(argv)

    model = args.model_path
    if model is None:
        import make_tiny_checkpoint

        model = make_tiny_checkpoint.make_checkpoint(
            "llama", os.path.join(ROOT, "tests", ".checkpoints"))
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="pdjax-faults-")
    os.makedirs(log_dir, exist_ok=True)
    from transformers import AutoTokenizer

    vocab_hi = min(len(AutoTokenizer.from_pretrained(model)), 4000)
    jobs = make_jobs(args.num_requests, args.max_new_tokens, vocab_hi, args.seed)
    t0 = time.perf_counter()
    reference(model, jobs)
    ref_s = time.perf_counter() - t0
    print(f"colocated reference: {sum(j.ref_ids is not None for j in jobs)} answers in "
          f"{ref_s:.0f} s", flush=True)

    from pdjax.ports import free_port

    bports = [free_port(), free_port()]
    env = child_env(JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    servers: list[Server] = []          # started (a Server starts when made): prefills, decodes
    router: Server | None = None
    try:
        for i in range(2):
            servers.append(pd_server(f"prefill{i}", "prefill", model, log_dir,
                                     bootstrap_port=bports[i], env=env,
                                     disaggregation_transfer_backend=args.transfer_backend))
        for i in range(2):
            servers.append(pd_server(f"decode{i}", "decode", model, log_dir, env=env,
                                     disaggregation_transfer_backend=args.transfer_backend))
        prefills, decodes = servers[:2], servers[2:]
        rport = free_port()
        router = Server("router", [sys.executable, "-m", "pdjax.router",
                                   *sum((["--prefill", s.url, str(b)] for s, b in
                                         zip(prefills, bports)), []),
                                   *sum((["--decode", s.url] for s in decodes), []),
                                   "--host", "127.0.0.1", "--port", str(rport)],
                        rport, log_dir, env)
        for s in servers + [router]:
            s.wait_healthy(STARTUP_TIMEOUT_S)
        print(f"servers up (logs in {log_dir})", flush=True)

        async def faults(done, open_gate):
            log = []
            n = len(jobs)
            rounds = args.kill_rounds
            marks, gates = fault_plan(n, rounds, args.concurrency)
            open_gate(gates[0])
            for r in range(rounds):
                at = marks[r]
                while done[0] < at and done[0] < n:
                    await asyncio.sleep(0.2)
                if done[0] >= n:
                    break
                victims = [prefills[0], decodes[0]]
                t_kill, killed_after = time.perf_counter(), done[0]
                kill_mono = time.monotonic()
                for s in victims:
                    s.kill()
                print(f"round {r + 1}: killed {[s.name for s in victims]} after {done[0]} "
                      f"requests", flush=True)
                await asyncio.sleep(args.down_s)
                for s in victims:
                    s.start()
                for s in victims:
                    await asyncio.to_thread(s.wait_healthy, STARTUP_TIMEOUT_S)
                log.append({"round": r + 1, "killed_after_requests": killed_after,
                            "restarted_after_requests": done[0],
                            "down_s": time.perf_counter() - t_kill, "kill_mono": kill_mono})
                open_gate(gates[r + 1])
                print(f"round {r + 1}: restarted in {log[-1]['down_s']:.1f} s", flush=True)
            return log

        load = asyncio.run(run_load(router.url, jobs, args.concurrency, args.request_timeout_s,
                                    args.deadline_s, faults))
        # Idle: every page back, then the leak check (the prefix cache may keep pages).
        deadline = time.monotonic() + args.idle_timeout_s
        leaked = {s.name: leaks(s) for s in servers}
        while any(leaked.values()) and time.monotonic() < deadline:
            time.sleep(1.0)
            leaked = {s.name: leaks(s) for s in servers}
        healthy = {s.name: http_get(s.url + "/health")[0] for s in servers + [router]}
        # A last request through every pair after the faults: the fleet still serves.
        after = http_post(router.url + "/generate",
                          {"input_ids": jobs[0].ids, "sampling_params": sampling(jobs[0])})[0]
    finally:
        for s in ([router] if router is not None else []) + servers[::-1]:
            s.stop()

    counts = {k: sum(j.outcome == k for j in jobs) for k in ("ok", "failed", "lost", "not_sent")}
    wrong = sum(j.detail.startswith("wrong") for j in jobs)
    ok_streams = [j for j in jobs if j.outcome == "ok" and j.kind == "stream"]
    ttft = summarize_ms(j.ttft_s for j in ok_streams if j.ttft_s is not None)
    itl = summarize_ms(x for j in ok_streams for x in j.itl_s)
    # When the failures ended, in seconds after the kill of their round (the last before).
    kills = [f.pop("kill_mono") for f in load["faults"]]
    fail_after_kill = sorted(
        round(j.end_s - max([k for k in kills if k <= j.end_s] or [j.end_s]), 2)
        for j in jobs if j.outcome == "failed" and j.end_s is not None)
    errors: dict[str, int] = {}
    for j in jobs:
        if j.outcome in ("failed", "lost"):
            key = f"{j.outcome}: {j.detail[:120]}"
            errors[key] = errors.get(key, 0) + 1
    result = {
        "date": now_iso(), "model": model, "transfer_backend": args.transfer_backend,
        "num_requests": len(jobs),
        "concurrency": args.concurrency, "kill_rounds": args.kill_rounds,
        "kinds": {k: sum(j.kind == k for j in jobs) for k in ("greedy", "stream", "abort",
                                                               "json")},
        **counts, "wrong": wrong, "pages_leaked": {k: v for k, v in leaked.items() if v},
        "health_after": healthy, "request_after_faults": after,
        "wall_s": load["wall_s"], "faults": load["faults"], "ttft_ms": ttft, "itl_ms": itl,
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:20]),
        "failed_s_after_kill": fail_after_kill,
        "log_dir": log_dir, "machine": machine_info()}
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    print(f"requests {len(jobs)}: ok {counts['ok']}, failed with a clear error "
          f"{counts['failed']}, lost {counts['lost']} (wrong {wrong}), not sent "
          f"{counts['not_sent']}; pages leaked: {result['pages_leaked'] or 0}; "
          f"TTFT p50/p99 {ttft.get('median')}/{ttft.get('p99')} ms, ITL p50/p99 "
          f"{itl.get('median')}/{itl.get('p99')} ms; wall {load['wall_s']:.0f} s")
    write_json(args.output_file, result)
    good = counts["lost"] == 0 and not result["pages_leaked"] and after == 200
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
