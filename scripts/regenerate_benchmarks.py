#!/usr/bin/env python
"""Regenerate BENCHMARKS.md: run every benchmark on this machine, then write the figures, the
command that produced each, and the date.

    python scripts/regenerate_benchmarks.py                 # SmolLM2-135M (~20 min on 2 CPU cores)
    python scripts/regenerate_benchmarks.py --quick         # tiny random checkpoint, small sizes
    python scripts/regenerate_benchmarks.py --only mixed    # one section; the others keep their JSON

Steps (each writes ``RESULTS_DIR/<name>.json``; BENCHMARKS.md is rendered from all JSON files
present, so a section can be rerun alone):

  serving    a PD deployment (prefill + decode over Mooncake + router) and a colocated server,
             started once; bench_serving.py against the colocated server and the router
  transfer   bench_transfer.py against the same servers
  mixed      bench_mixed.py (offline engine, mixed batches off / on / on with an ITL target,
             the target sweep, and the gap plot docs/images/bench_mixed_itl.png)
  vs_hf      bench_vs_hf.py (offline engine vs transformers)
  load       bench_load.py (model load: source checkpoint vs its pdjax Orbax conversion)
  overlap    bench_step_overlap.py (host share of a step at batch 32, and the device's idle time
             between forwards with overlapped scheduling)
  notebook   notebooks/bucket_shapes.ipynb executed in place (outputs saved) via nbclient
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import ROOT, fmt, machine_info, now_iso  # noqa: E402

STEPS = ("serving", "transfer", "mixed", "vs_hf", "load", "overlap", "notebook")
NOTEBOOK = os.path.join("notebooks", "bucket_shapes.ipynb")
MIXED_PLOT = os.path.join("docs", "images", "bench_mixed_itl.png")   # shown in BENCHMARKS.md


def sizes(quick: bool, model_path: str | None) -> dict:
    """Server flags and bench arguments; ``quick`` is the tiny-checkpoint smoke mode."""
    model = ["--model-path", model_path] if model_path else []
    if quick:
        server = model + ["--dtype", "float32", "--page-size", "8", "--max-total-tokens", "4096",
                          "--max-running-requests", "16", "--chunked-prefill-size", "64",
                          "--context-length", "128"]
        return {"server": server,
                "serving": ["--num-prompts", "8", "--random-input-len", "32",
                            "--random-output-len", "8", "--max-concurrency", "4"],
                "transfer": ["--input-lens", "20,100", "--requests-per-len", "2"],
                "mixed": ["--batch-size", "4", "--decode-prompt-len", "16",
                          "--long-prompt-len", "100", "--steady-steps", "8", "--repeats", "3",
                          "--plot-file", MIXED_PLOT],
                "vs_hf": ["--num-prompts", "4", "--input-len", "24", "--output-len", "8"]}
    server = model + ["--page-size", "16", "--max-total-tokens", "16384",
                      "--max-running-requests", "16", "--chunked-prefill-size", "256",
                      "--context-length", "1024"]
    return {"server": server,
            "serving": ["--num-prompts", "16", "--random-input-len", "128",
                        "--random-output-len", "32", "--max-concurrency", "16"],
            "transfer": ["--input-lens", "64,256,960", "--requests-per-len", "2"],
            "mixed": ["--batch-size", "8", "--decode-prompt-len", "32", "--long-prompt-len", "2000",
                      "--steady-steps", "16", "--repeats", "1", "--context-length", "2016",
                      "--target-factors", "2,1.5,3", "--plot-file", MIXED_PLOT],
            "vs_hf": ["--num-prompts", "8", "--input-len", "128", "--output-len", "32"]}


def _without(flags: list[str], overrides: list[str]) -> list[str]:
    """``flags`` minus every ``--name value`` pair that ``overrides`` sets again."""
    names = {f for f in overrides if f.startswith("--")}
    out, i = [], 0
    while i < len(flags):
        if flags[i] in names:
            i += 2
            continue
        out.append(flags[i])
        i += 1
    return out


def run_cmd(cmd: list[str], log_path: str) -> float:
    print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        rc = subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                             env={**os.environ, "PYTHONPATH": ROOT})
    if rc != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"command failed ({rc}): {' '.join(cmd)}\n{tail}")
    return time.perf_counter() - t0


def show(cmd: list[str]) -> str:
    """A command as a reader types it, from the repository root."""
    out = []
    for c in cmd:
        if c == sys.executable:
            c = "python"
        elif c.startswith(ROOT + os.sep):
            c = os.path.relpath(c, ROOT)
        out.append(shlex.quote(c))
    return " ".join(out)


def model_name(data: dict) -> str:
    m = data["model"]
    return os.path.relpath(m, ROOT) if m.startswith(ROOT + os.sep) else m


def record(results_dir: str, name: str, commands: list[str]) -> None:
    path = os.path.join(results_dir, f"{name}.json")
    with open(path) as f:
        data = json.load(f)
    data["commands"] = commands
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def step_servers(args, cfg, results_dir: str, logs: str) -> None:
    import bench_transfer

    py = sys.executable
    targs = bench_transfer.parse_args([*cfg["server"], *cfg["transfer"]])
    with bench_transfer.deployment(targs) as urls:
        server_cmds = [
            "python -m pdjax.serve " + show(cfg["server"]) + " --port 30000  # colocated",
            "python -m pdjax.serve " + show(cfg["server"]) + " --role prefill --port 30001 "
            "--disaggregation-bootstrap-port 8998 --disaggregation-transfer-backend mooncake",
            "python -m pdjax.serve " + show(cfg["server"]) + " --role decode --port 30002 "
            "--disaggregation-transfer-backend mooncake",
            "python -m pdjax.router --prefill http://127.0.0.1:30001 8998 "
            "--decode http://127.0.0.1:30002 --port 30003"]
        if "serving" in args.only:
            for name, target, port in (("serving_colocated", "colocated", 30000),
                                       ("serving_pd", "router", 30003)):
                out = os.path.join(results_dir, f"{name}.json")
                # Through the router, the engine metrics come from the decode server.
                metrics = urls["colocated" if target == "colocated" else "decode"]
                cmd = [py, "scripts/bench_serving.py", "--base-url", urls[target],
                       "--metrics-url", metrics, *cfg["serving"], "--output-file", out]
                run_cmd(cmd, os.path.join(logs, f"{name}.log"))
                shown = ["python", "scripts/bench_serving.py", "--port", str(port), *cfg["serving"]]
                if target == "router":
                    shown += ["--metrics-url", "http://127.0.0.1:30002"]
                record(results_dir, name, server_cmds[:1] + [show(shown)] if target == "colocated"
                       else server_cmds[1:] + [show(shown)])
        if "transfer" in args.only:
            out = os.path.join(results_dir, "transfer.json")
            cmd = [py, "scripts/bench_transfer.py", *cfg["server"], *cfg["transfer"],
                   *[f"--{role}-url={url}" for role, url in urls.items()], "--output-file", out]
            run_cmd(cmd, os.path.join(logs, "transfer.log"))
            record(results_dir, "transfer", [show(["python", "scripts/bench_transfer.py",
                                                   *cfg["server"], *cfg["transfer"]])
                                              + "  # starts its own servers"])


def step_offline(name: str, script: str, extra: list[str], results_dir: str, logs: str) -> None:
    out = os.path.join(results_dir, f"{name}.json")
    cmd = [sys.executable, f"scripts/{script}", *extra, "--output-file", out]
    run_cmd(cmd, os.path.join(logs, f"{name}.log"))
    record(results_dir, name, [show(["python", f"scripts/{script}", *extra])])


def step_notebook(results_dir: str) -> None:
    import nbclient
    import nbformat

    out = os.path.join(results_dir, "notebook.json")
    os.environ["BUCKET_SHAPES_JSON"] = out
    path = os.path.join(ROOT, NOTEBOOK)
    nb = nbformat.read(path, as_version=4)
    print(f"$ execute {NOTEBOOK} (nbclient)", flush=True)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": os.path.join(ROOT, "notebooks")}}).execute()
    nbformat.write(nb, path)
    record(results_dir, "notebook", [f"python scripts/regenerate_benchmarks.py --only notebook  "
                                     f"# executes {NOTEBOOK} with nbclient"])


# ------------------------------------------------------------------------------ rendering

def _load(results_dir: str, name: str) -> dict | None:
    path = os.path.join(results_dir, f"{name}.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _commands(data: dict) -> list[str]:
    return ["```bash", *data.get("commands", []), "```", ""]


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return lines + [""]


def _mixed_section(mx: dict) -> list[str]:
    lines = ["## Mixed batches during a long-prompt arrival (bench_mixed.py)", "",
             f"Date: {mx['date']}. Model: `{model_name(mx)}`. {mx['batch_size']} requests decode "
             f"steadily; a {mx['long_prompt_len']}-token prompt arrives (chunked prefill "
             f"{mx['chunked_prefill_size']}); {mx['repeats']} round(s) per setting, all settings "
             "interleaved in one process. Settings: mixed batches off, on, and on with "
             f"`--target-itl-ms {fmt(mx['target_itl_ms'])}` ({fmt(mx['target_factor'])} x the "
             f"steady decode step of {fmt(mx['steady_decode_step_ms'])} ms, measured first), "
             "then the target sweep. Decode ITL in ms: steady state (a window before the "
             "arrival), and during the arrival (every gap of every decoding request that "
             "overlaps the interval from the arrival to the long prompt's first token). Window "
             "throughput: decode tokens plus the long prompt's tokens over that interval.", ""]
    names = ["mixed_off", "mixed_on", "mixed_on_target"] + [
        r["setting"] for r in mx.get("target_sweep", []) if r["setting"] != "mixed_on_target"]
    rows = []
    for name in names:
        r = mx[name]
        rows.append([name.replace("_", " "), r["steady_itl_ms"]["p50"], r["steady_itl_ms"]["p99"],
                     r["arrival_itl_ms"]["p50"], r["arrival_itl_ms"]["p99"],
                     r["arrival_itl_ms"]["max"], r["ratio_p99_to_steady_p99"],
                     r["long_prompt_ttft_ms"], r.get("window_throughput_tok_s"),
                     ", ".join(f"{k} {v}" for k, v in sorted(r["window_forward_modes"].items())),
                     r["window_host_overhead"]["host_overhead_fraction"]])
    lines += _table(["setting", "steady ITL p50", "steady ITL p99", "arrival ITL p50",
                     "arrival ITL p99", "arrival ITL max", "arrival p99 / steady p99",
                     "long prompt TTFT", "window tok/s", "forwards in window", "host overhead"],
                    rows)
    lines += [f"With the target, arrival ITL p99 / mixed off: "
              f"**{fmt(mx['arrival_p99_target_over_off'])}**; long-prompt TTFT / mixed off: "
              f"{fmt(mx['ttft_target_over_off'])}; window throughput / mixed off: "
              f"{fmt(mx['throughput_target_over_off'])}. Mixed on without a target: arrival ITL "
              f"p99 / off {fmt(mx['arrival_p99_on_over_off'])}, TTFT / off "
              f"{fmt(mx['ttft_on_over_off'])}. Compiles after warm-up: "
              f"{mx['compiles_after_warmup']}.", ""]
    if mx.get("target_sweep"):
        lines += ["Target sweep (arrival ITL p99 against the long prompt's TTFT; on a shared "
                  "machine neighbouring targets are within its noise):", ""]
        lines += _table(["target ITL ms", "arrival ITL p99", "arrival p99 / steady p99",
                         "long prompt TTFT", "window tok/s"],
                        [[r["target_itl_ms"], r["arrival_itl_p99_ms"], r["ratio_p99_to_steady_p99"],
                          r["long_prompt_ttft_ms"], r["window_throughput_tok_s"]]
                         for r in mx["target_sweep"]])
    if mx.get("plot_file"):
        path = os.path.relpath(os.path.join(ROOT, mx["plot_file"]), ROOT)
        lines += [f"![inter-token gaps of every decoding request]({path})", "",
                  "Each line is one decoding request's inter-token gaps (log scale) against the "
                  "time since the long prompt arrived (first round of each setting); the dashed "
                  "line is the long prompt's first token.", ""]
    lines += ["Where even the smallest mixed step costs more than the target (each step's chunk "
              "attends over the long prompt's whole context so far, so late in a long prompt "
              "the smallest mixed step grows past the target), the prompt advances by the rest "
              "of the smallest token bucket next to the decode rows per step (a sub-page chunk; "
              "whole pages for PD prefill), and the decode gaps follow that floor instead of the "
              "target.", ""]
    return lines + _commands(mx)


def render(results_dir: str, quick: bool) -> str:
    lines = ["# pdjax benchmarks", "",
             "Figures from this machine, produced by `python scripts/regenerate_benchmarks.py"
             + (" --quick" if quick else "") + "` (each section lists its own commands and date). "
             "The machine is a small shared CPU box: absolute figures are CPU figures and vary "
             "with the load of other processes; the ratios within one section come from one "
             "run, side by side.", ""]
    mach = None
    for name in ("serving_colocated", "mixed", "vs_hf", "transfer"):
        d = _load(results_dir, name)
        if d and d.get("machine"):
            mach = d["machine"]
            break
    if mach:
        lines += [f"Machine: {mach.get('cpu_count')} CPU cores, {mach.get('platform')}, Python "
                  f"{mach.get('python')}, jax {mach.get('jax')} ({mach.get('jax_backend')}).", ""]
    s_c, s_pd = _load(results_dir, "serving_colocated"), _load(results_dir, "serving_pd")
    if s_c:
        lines += ["## Online serving (bench_serving.py)", "",
                  f"Date: {s_c['date']}. Model: `{model_name(s_c)}`. Random prompts, "
                  f"{s_c['num_prompts']} requests, {s_c['random_input_len']} input / "
                  f"{s_c['random_output_len']} output tokens, request rate {s_c['request_rate']}, "
                  f"max concurrency {s_c['max_concurrency']}; streamed `/v1/completions`. "
                  "Latencies in ms. Host overhead: the engine's per-step scheduling + batch "
                  "building + sampling time vs its forward time, from `/metrics` "
                  "(`pdjax:step_host_time_seconds`, `pdjax:step_forward_time_seconds`).", ""]
        rows = []
        for label, d in (("colocated", s_c), ("PD (router)", s_pd)):
            if not d:
                continue
            st = d["server_step_times"]
            rows.append([label, d["request_throughput"], d["output_throughput"],
                         d["median_ttft_ms"], d["p99_ttft_ms"], d["median_tpot_ms"],
                         d["median_itl_ms"], d["p99_itl_ms"], d["median_e2e_latency_ms"],
                         d["server_compile_count"], st.get("host_time_per_step_ms"),
                         st.get("forward_time_per_step_ms")])
        lines += _table(["server", "req/s", "output tok/s", "TTFT p50", "TTFT p99", "TPOT p50",
                         "ITL p50", "ITL p99", "E2E p50", "compiles after warm-up",
                         "host ms/step", "forward ms/step"], rows)
        lines += ["The PD row's compile count and host/forward times are the decode server's "
                  "(`--metrics-url`).", ""]
        lines += _commands(s_c) + (_commands(s_pd) if s_pd else [])
    mx = _load(results_dir, "mixed")
    if mx:
        lines += _mixed_section(mx)
    tr = _load(results_dir, "transfer")
    if tr:
        lines += ["## PD KV transfer (bench_transfer.py)", "",
                  f"Date: {tr['date']}. Model: `{model_name(tr)}`; transfer backend "
                  f"{tr['transfer_backend']} (TCP over loopback). Per request, from the prefill "
                  "server's `/metrics`. The PD transfer time is the server's "
                  "`kv_transfer_latency_seconds`: from the first chunk queued to Success, so "
                  "for a prompt of several chunks it includes the forwards of the later chunks "
                  "(compute, not data movement); for a one-chunk prompt it is the write plus "
                  "the status message. The PD write columns are the time inside the prefill's "
                  "transfer-engine batch writes alone (`kv_transfer_write_seconds`), the data "
                  "plane's own rate. The raw write is one `batch_write` of the same bytes in "
                  "the same number of copies between two engines in the bench process. TTFT in "
                  "ms, median.", ""]
        rows = [[r["input_len"], r["transfer_bytes_per_request"], r["transfer_pages_per_request"],
                 r["transfer_copy_ops_per_request"], r["transfer_chunks_per_request"],
                 r["transfer_time_ms"], r["transfer_gbps"],
                 r.get("write_time_ms_per_request"), r.get("write_gbps"),
                 r["raw_write_time_ms"], r["raw_write_gbps"], r.get("write_gbps_pd_over_raw"),
                 r["ttft_colocated_ms"], r["ttft_pd_ms"], r["ttft_pd_over_colocated"]]
                for r in tr["rows"]]
        lines += _table(["prompt tokens", "bytes", "pages", "copy ops", "chunks", "PD transfer ms",
                         "PD GB/s", "PD write ms", "PD write GB/s", "raw write ms", "raw GB/s",
                         "PD write / raw GB/s",
                         "TTFT colocated", "TTFT PD", "TTFT PD / colocated"], rows)
        lines += _commands(tr)
    hf = _load(results_dir, "vs_hf")
    if hf:
        lines += ["## pdjax vs transformers (bench_vs_hf.py)", "",
                  f"Date: {hf['date']}. Model: `{model_name(hf)}`, {hf['dtype']}. "
                  f"{hf['num_prompts']} prompts x {hf['input_len']} random tokens, "
                  f"{hf['output_len']} greedy output tokens each (EOS ignored), one batch each "
                  "side, after an untimed warm-up run.", ""]
        st = hf["pdjax_step_times"]
        lines += _table(["", "output tok/s", "time s"],
                        [["pdjax Engine", hf["pdjax_output_throughput"], hf["pdjax_time_s"]],
                         [f"transformers generate ({hf['hf_torch_threads']} threads)",
                          hf["hf_output_throughput"], hf["hf_time_s"]]])
        lines += [f"Ratio pdjax / transformers: **{fmt(hf['throughput_ratio_pdjax_over_hf'])}**. "
                  f"Tokens match: {hf['num_prompts_exact_match']}/{hf['num_prompts']} prompts "
                  f"exactly, {hf['num_prompts_match_tie_aware']}/{hf['num_prompts']} tie-aware "
                  f"(DESIGN.md §5). pdjax host overhead: {fmt(st['host_time_per_step_ms'])} ms "
                  f"host vs {fmt(st['forward_time_per_step_ms'])} ms forward per step "
                  f"({st['num_steps']} steps); compiles after warm-up: "
                  f"{hf['pdjax_compiles_after_warmup']}.", ""]
        lines += _commands(hf)
    ld = _load(results_dir, "load")
    if ld:
        lines += ["## Model load: source checkpoint vs Orbax (bench_load.py)", "",
                  f"Date: {ld['date']}. Model: `{model_name(ld)}`, {ld['dtype']}, one device. "
                  "Wall time of `load_model` until every parameter is on the device; the two "
                  f"alternate over {ld['repeats']} repeats. The Orbax checkpoint was written by "
                  "`python -m pdjax.convert` (already dequantized and stacked)"
                  + (f" in {fmt(ld['convert_s'])} s." if ld.get("convert_s") else "."), ""]
        lines += _table(["", "median load s", "all runs s"],
                        [["source checkpoint", ld["median_source_load_s"],
                          ", ".join(fmt(v) for v in ld["source_load_s"])],
                         ["pdjax Orbax checkpoint", ld["median_orbax_load_s"],
                          ", ".join(fmt(v) for v in ld["orbax_load_s"])]])
        lines += [f"Orbax loads **{fmt(ld['speedup_orbax_over_source'])}x** faster.", ""]
        lines += _commands(ld)
    ov = _load(results_dir, "overlap")
    if ov:
        s, o = ov["sync"], ov["overlap"]
        lines += ["## Host share and overlapped scheduling (bench_step_overlap.py)", "",
                  f"Date: {ov['date']}. Model: `{model_name(ov)}`, float32, {ov['backend']}. "
                  f"{ov['batch']} greedy requests ({ov['prompt_len']} prompt tokens, "
                  f"{ov['new_tokens']} new each), run without and with overlapped scheduling, "
                  "alternating, median run shown; the window is the full-batch decode steps. "
                  "Host share: the engine's host time (scheduling, batch and sampling inputs, "
                  "reading results) over host + forward (dispatch + waiting for the device). "
                  "Device idle: from the completion timestamp of every forward "
                  "(`pdjax.runner.timeline`) to the dispatch of the next one; a forward "
                  "dispatched while the previous one still ran had no gap at all.", ""]
        lines += _table(["", "host ms/step", "forward ms/step", "host share", "device step ms",
                         "device idle ms/step", "device idle share", "steps dispatched after the "
                         "previous finished", "wall s (all runs)"],
                        [[label, r["host_ms_per_step"], r["forward_ms_per_step"],
                          r["host_share"], r["device_step_ms"], r["device_idle_ms_per_step"],
                          r["device_idle_share"], f"{r['exposed_steps']}/{r['num_window_steps']}",
                          ", ".join(fmt(v) for v in r["wall_s_all"])]
                         for label, r in (("--disable-overlap-schedule", s), ("overlap (default)", o))])
        lines += [f"Host share without overlap: **{fmt(100 * s['host_share'])}%** (target <= 5%); "
                  f"device idle between forwards with overlap: **{fmt(100 * o['device_idle_share'])}%** "
                  f"of the step (target <= 2%). Tokens equal in every run: {ov['tokens_equal']}; "
                  f"compiles after warm-up: {ov['compiles_after_warmup']}.", ""]
        lines += _commands(ov)
        tiny = _load(results_dir, "overlap_tiny")
        if tiny:
            ts, to = tiny["sync"], tiny["overlap"]
            lines += [f"The same on the tiny random Llama (`{model_name(tiny)}`), whose forward "
                      f"is far shorter than the host work of a step (the regime of a small model "
                      f"on a GPU): host share without overlap {fmt(100 * ts['host_share'])}% "
                      f"({fmt(ts['host_ms_per_step'])} ms host, {fmt(ts['forward_ms_per_step'])} ms "
                      f"forward); with overlap the device is idle "
                      f"{fmt(100 * to['device_idle_share'])}% of the step "
                      f"({fmt(to['device_idle_ms_per_step'])} of {fmt(to['device_step_ms'])} ms): "
                      "overlap hides the host work only up to the length of a forward.", ""]
            lines += _commands(tiny)
    nbr = _load(results_dir, "notebook")
    if nbr:
        lines += ["## Bucket shapes: padding waste vs compile count (notebooks/bucket_shapes.ipynb)", "",
                  f"A synthetic trace of {nbr['num_requests']} requests replayed through the "
                  f"scheduler (page size {nbr['page_size']}, chunk {nbr['chunked_prefill_size']}, "
                  f"{nbr['max_running_requests']} rows, context {nbr['context_length']}); the "
                  "notebook has the plots.", ""]
        rows = [[r["trace"], r["bucket_set"], 100 * r["token_waste"], 100 * r["page_table_waste"],
                 r["warmup_compiles"], r["shapes_used"]] for r in nbr["results"]]
        lines += _table(["trace", "bucket set", "token waste %", "page-table waste %",
                         "warm-up compiles", "shapes used"], rows)
        lines += _commands(nbr)
    lines += [f"_Rendered {now_iso()}._", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny random checkpoint, small sizes")
    p.add_argument("--model-path", default=None, help="default: SmolLM2 (or the tiny Llama with --quick)")
    p.add_argument("--only", nargs="+", choices=STEPS, default=list(STEPS))
    p.add_argument("--results-dir", default=os.path.join(ROOT, "build", "benchmarks"))
    p.add_argument("--output", default=os.path.join(ROOT, "BENCHMARKS.md"))
    p.add_argument("--render-only", action="store_true", help="rewrite BENCHMARKS.md from the JSON files")
    args = p.parse_args(argv)
    model = args.model_path
    if args.quick and model is None:
        import make_tiny_checkpoint

        model = make_tiny_checkpoint.make_checkpoint("llama", os.path.join(ROOT, "tests", ".checkpoints"))
    cfg = sizes(args.quick, model)
    os.makedirs(args.results_dir, exist_ok=True)
    logs = os.path.join(args.results_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    if not args.render_only:
        t0 = time.perf_counter()
        if {"serving", "transfer"} & set(args.only):
            step_servers(args, cfg, args.results_dir, logs)
        if "mixed" in args.only:
            step_offline("mixed", "bench_mixed.py", [*_without(cfg["server"], cfg["mixed"]), *cfg["mixed"]],
                         args.results_dir, logs)
        if "vs_hf" in args.only:
            flags = list(cfg["server"])
            if "--dtype" not in flags:
                flags += ["--dtype", "float32"]
            step_offline("vs_hf", "bench_vs_hf.py", [*flags, *cfg["vs_hf"]], args.results_dir, logs)
        if "load" in args.only:
            step_offline("load", "bench_load.py", [*(["--model-path", model] if model else []),
                                                   "--repeats", "3"], args.results_dir, logs)
        if "overlap" in args.only:
            step_offline("overlap", "bench_step_overlap.py",
                         [*(["--model-path", model] if model else []),
                          *(["--batch", "8", "--new-tokens", "16"] if args.quick else
                            ["--batch", "32", "--new-tokens", "40"]), "--repeats", "2"],
                         args.results_dir, logs)
            if not args.quick:       # and a model whose forward is far shorter than the host work
                import make_tiny_checkpoint

                tiny = make_tiny_checkpoint.make_checkpoint("llama", os.path.join(ROOT, "tests", ".checkpoints"))
                step_offline("overlap_tiny", "bench_step_overlap.py",
                             ["--model-path", tiny, "--batch", "32", "--new-tokens", "64",
                              "--repeats", "3"], args.results_dir, logs)
        if "notebook" in args.only:
            step_notebook(args.results_dir)
        print(f"benchmarks done in {time.perf_counter() - t0:.0f} s", flush=True)
    with open(args.output, "w") as f:
        f.write(render(args.results_dir, args.quick))
    print(f"wrote {args.output}; machine: {machine_info()}")


if __name__ == "__main__":
    main()
