"""The collective bytes of a mixed step (one prefill chunk + decode rows), with and without DP
attention, read from the compiled HLO (issue 41 item 5; BENCHMARKS.md "The mixed step's
collective bytes").

Two subcommands:

    compile   build ``pdjax.aot``'s abstract engine from the flags after ``--`` (any
              ``python -m pdjax.aot`` flags: target, model, TP / EP / DP attention), compile
              the extend bucket that holds the mixed step (``--prefill-tokens`` in one chunk
              plus ``--decode-rows`` decode tokens spread over the DP ranks) and the decode
              bucket of ``--decode-requests``, read each executable's post-optimization HLO
              (``pdjax.aot.hlo_bytes``) and write one JSON file (``--out``).
    report    print the JSON files of ``compile`` as one table next to seed 003's figures
              and write a PNG bar plot (``--png``) and the merged JSON (``--json``).

Bytes are per device per step (``hlo_bytes``'s ``buffer_bytes``: the gathered buffer of an
all-gather, the operand of the others; ``sent_bytes``: what a ring sends). Example (the real
config: compile-only, minutes per layout)::

    CUDA_VISIBLE_DEVICES=-1 .venv-cuda/bin/python scripts/bench_step_bytes.py compile \\
        --label "TP 8, EP 8 none" --out /tmp/a.json -- --gpu h200 \\
        --model-path pdjax/aot/configs/deepseek-v3.2-fp8 --tp-size 8 --ep-size 8 ...
    .venv/bin/python scripts/bench_step_bytes.py report /tmp/*.json --png out.png
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pdjax.aot.hlo_bytes import KINDS, collective_bytes, format_bytes  # noqa: E402

# Seed 003 ("GLM-5.3 inference, the mixed step"), its table "the account of a mixed step and of
# a decode step", translated; GLM-5.3 on 8 x H200, --tp 8 --ep-size 8 --attn-dp-size 8, FP8
# weights and KV, hidden 6144, 75 MoE layers; P = 8192 prefill rows, D = 192 decode rows
# (32 requests x 6 MTP rows), N = 8384. Bytes as the seed states them (decimal units).
SEED = {
    "source": "shared/seeds/003 (GLM-5.3, 8 x H200, --tp 8 --ep-size 8 --attn-dp-size 8)",
    "rows": [
        # (item, pure decode 192 rows, mixed 8384 rows, the seed's formula)
        ("DP gather (one per layer, BF16)", 2.36e6, 103e6, "N x 6144 x 2"),
        ("MoE dispatch (one layer, FP8)", 9.4e6, 0.41e9, "N x 8 x 6144"),
        ("MoE combine (one layer, BF16)", 18.9e6, 0.82e9, "2 x dispatch"),
        ("MoE dispatch + combine (75 layers)", 28e6, 92e9, "75 x (dispatch + combine)"),
    ],
}


def _engine(aot_flags: list[str]):
    from pdjax.aot.__main__ import build_parser
    from pdjax.aot.engine import AbstractEngine
    from pdjax.aot.targets import gpu_target, tpu_target
    from pdjax.config import ServerArgs
    from pdjax.engine.settings import check_checkpoint_paths

    ns = build_parser().parse_args(aot_flags)
    args = ServerArgs.from_cli_args(ns)
    check_checkpoint_paths(args)
    target = (gpu_target(ns.gpu, num_gpus=args.tp_size) if ns.gpu is not None
              else tpu_target(ns.topology))
    return args, AbstractEngine(args, target)


def _compile(engine, key, hlo_dir, label):
    entry = next(e for e in engine.entries("all") if e.key == key)
    result = engine.compile_entry(entry)
    if not result.ok:
        raise RuntimeError(f"{entry.name}: {result.error}")
    text = result.executable.as_text()
    if hlo_dir:
        safe = "".join(c if c.isalnum() else "_" for c in f"{label}_{key.entry}")
        with open(os.path.join(hlo_dir, safe + ".hlo"), "w") as f:
            f.write(text)
    out = collective_bytes(text)
    out.update(bucket=dict(entry=key.entry, num_tokens=key.num_tokens, num_rows=key.num_rows,
                           pages_per_seq=key.pages_per_seq),
               compile_s=round(result.seconds, 1), temp_bytes=result.temp_bytes)
    return out


def cmd_compile(ns, aot_flags) -> int:
    for name in ("prefill_tokens", "decode_rows", "decode_requests"):
        if getattr(ns, name) < 0:
            print(f"error: {name}: must be >= 0, got {getattr(ns, name)}", file=sys.stderr)
            return 2
    try:
        args, engine = _engine(aot_flags)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dp = args.dp_size
    pages = engine.buckets.pages_per_seq_buckets[-1]
    # Under DP attention a bucket is one rank's padded segment: the prefill chunk's rank also
    # holds its share of the decode rows, and every rank is padded to it.
    mixed_tokens = ns.prefill_tokens + -(-ns.decode_rows // dp)
    mixed = engine.buckets.pick("mixed", mixed_tokens, min(1 + -(-ns.decode_requests // dp),
                                                         engine.buckets.max_rows), pages)
    decode_rows = -(-ns.decode_requests // dp)
    decode = engine.buckets.pick("decode", decode_rows, decode_rows, pages)
    cfg = engine.model_cfg
    result = dict(
        label=ns.label,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        command=" ".join(["scripts/bench_step_bytes.py", "compile", "--label", repr(ns.label),
                          "--"] + aot_flags),
        model=os.path.basename(os.path.normpath(args.model_path)),
        target=engine.target.name, tp=args.tp_size, ep=args.ep_size,
        moe_a2a_backend=args.moe_a2a_backend, dp_attention=dp,
        hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
        step=dict(prefill_tokens=ns.prefill_tokens, decode_rows=ns.decode_rows,
                  decode_requests=ns.decode_requests),
        mixed=None, decode=None)
    print(f"{ns.label}: mixed step {mixed}, decode {decode}", flush=True)
    for name, key in (("mixed", mixed), ("decode", decode)):
        result[name] = _compile(engine, key, ns.hlo_dir, ns.label)
        print(f"  {name}: compiled in {result[name]['compile_s']} s; "
              + ", ".join(f"{k} {format_bytes(v['buffer_bytes'])}"
                          for k, v in result[name]["total"].items() if v["count"]),
              flush=True)
    with open(ns.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


# ---------------------------------------------------------------------------------- report
def _layer_loop(step: dict, num_layers: int) -> dict | None:
    """The scan over layers: the loop with the largest trip count not above the model's
    layers among those holding collectives (the MoE layers' scan)."""
    loops = [lp for lp in step["loops"] if lp["trip_count"] <= num_layers]
    return max(loops, key=lambda lp: lp["trip_count"]) if loops else None


def summarize(run: dict) -> list[dict]:
    """One row per (run, step): per-step and per-MoE-layer buffer bytes by kind."""
    rows = []
    for step in ("decode", "mixed"):
        s = run[step]
        loop = _layer_loop(s, run["num_layers"])
        rows.append(dict(
            label=run["label"], model=run["model"], step=step,
            bucket=f"{s['bucket']['entry']} T={s['bucket']['num_tokens']}"
                   + (f" per rank x {run['dp_attention']}" if run["dp_attention"] > 1 else ""),
            per_step={k: s["total"][k]["buffer_bytes"] for k in KINDS},
            sent_per_step=sum(s["total"][k]["sent_bytes"] for k in KINDS),
            layer_trip=loop["trip_count"] if loop else 0,
            per_layer={k: (loop["per_iteration"][k]["buffer_bytes"] if loop else 0)
                       for k in KINDS}))
    return rows


SHORT = {"all-gather": "AG", "reduce-scatter": "RS", "all-reduce": "AR", "all-to-all": "A2A",
         "ragged-all-to-all": "ragged A2A", "collective-permute": "permute"}


def format_table(rows: list[dict]) -> str:
    head = ("| model | layout | step (bucket) | per MoE layer (scan of L) | per step, by kind | "
            "per step, all | ring-sent per step |")
    lines = [head, "|" + "---|" * 7]
    for r in rows:
        layer = ", ".join(f"{SHORT[k]} {format_bytes(v)}" for k, v in r["per_layer"].items()
                          if v) or "-"
        step = ", ".join(f"{SHORT[k]} {format_bytes(v)}" for k, v in r["per_step"].items() if v)
        lines.append(f"| {r['model']} | {r['label']} | {r['step']} ({r['bucket']}) | {layer} "
                     f"(L = {r['layer_trip']}) | {step} | "
                     f"{format_bytes(sum(r['per_step'].values()))} | "
                     f"{format_bytes(r['sent_per_step'])} |")
    lines += ["", f"Seed 003's table ({SEED['source']}), bytes as it states them:", "",
              "| item | pure decode (192 rows) | mixed (8,384 rows) | seed's formula |",
              "|---|---|---|---|"]
    for item, dec, mix, formula in SEED["rows"]:
        lines.append(f"| {item} | {format_bytes(dec)} | {format_bytes(mix)} | {formula} |")
    return "\n".join(lines)


def _grouped(ax, labels, series, colors):
    """Bars of ``series`` ({name: [value per label]}) side by side at each label, log y."""
    names = [n for n, vals in series.items() if any(vals)]
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        xs = [j - 0.4 + width * (i + 0.5) for j in range(len(labels))]
        ax.bar(xs, [v or float("nan") for v in series[name]], width, label=name,
               color=colors.get(name))
    ax.set_xticks(range(len(labels)), labels, fontsize=7, rotation=60, ha="right")
    ax.set_yscale("log")
    ax.legend(fontsize=7)


def plot(rows: list[dict], path: str) -> None:
    """One panel per model (per-step buffer bytes by kind, each layout's decode and mixed
    step) and one of the mixed step's bytes per MoE layer of the real-size runs next to seed
    003's DP gather and dispatch + combine. ``ImportError`` without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows}, key=lambda m: (not m.startswith("tiny"), m))
    fig, axes = plt.subplots(1, len(models) + 1, figsize=(5 * (len(models) + 1), 6))
    colors = dict(zip(KINDS, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple",
                              "tab:gray")))
    colors.update({"seed: DP gather": "black", "seed: dispatch + combine": "dimgray"})
    for ax, model in zip(axes, models):
        mine = [r for r in rows if r["model"] == model]
        _grouped(ax, [f"{r['label']}, {r['step']}" for r in mine],
                 {k: [r["per_step"][k] / 1e6 for r in mine] for k in KINDS}, colors)
        ax.set_title(f"{model}\nper device per step (compiled HLO)", fontsize=9)
        ax.set_ylabel("MB (buffer bytes)")
    ax = axes[-1]
    real = [r for r in rows if r["step"] == "mixed" and not r["model"].startswith("tiny")]
    labels = ["seed 003 (GLM-5.3, N = 8,384)"] + [f"{r['model']}: {r['label']}" for r in real]
    series = {"seed: DP gather": [SEED["rows"][0][2] / 1e6] + [0] * len(real),
              "seed: dispatch + combine": [(SEED["rows"][1][2] + SEED["rows"][2][2]) / 1e6]
              + [0] * len(real)}
    series.update({k: [0] + [r["per_layer"][k] / 1e6 for r in real] for k in KINDS})
    _grouped(ax, labels, series, colors)
    ax.set_title("mixed step, one MoE layer\n(measured: per device)", fontsize=9)
    ax.set_ylim(bottom=1)              # hide the sub-MB helpers (send-count gathers)
    ax.set_ylabel("MB")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def cmd_report(ns) -> int:
    runs = []
    for path in ns.runs:
        with open(path) as f:
            runs.append(json.load(f))
    rows = [r for run in runs for r in summarize(run)]
    print(format_table(rows))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(dict(seed=SEED, runs=runs), f, indent=1)
    if ns.png:
        try:
            plot(rows, ns.png)
        except ImportError:
            csv = os.path.splitext(ns.png)[0] + ".csv"
            with open(csv, "w") as f:
                f.write("model,layout,step," + ",".join(KINDS) + "\n")
                for r in rows:
                    f.write(f"{r['model']},{r['label']},{r['step']},"
                            + ",".join(str(r["per_step"][k]) for k in KINDS) + "\n")
            print(f"matplotlib is not installed: wrote {csv} instead of the PNG")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    aot_flags = []
    if "--" in argv:
        i = argv.index("--")
        argv, aot_flags = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile", help="compile one layout's mixed and decode buckets")
    c.add_argument("--label", required=True, help="the layout's name in the table")
    c.add_argument("--out", required=True, help="JSON file to write")
    c.add_argument("--prefill-tokens", type=int, default=8192,
                   help="tokens of the prefill chunk (seed 003: 8192)")
    c.add_argument("--decode-rows", type=int, default=192,
                   help="decode tokens of the mixed step (seed 003: 192 = 32 x 6 MTP rows)")
    c.add_argument("--decode-requests", type=int, default=32,
                   help="requests of the pure-decode step (seed 003: 32)")
    c.add_argument("--hlo-dir", help="also write each executable's HLO text here")
    r = sub.add_parser("report", help="table + plot of compile's JSON files")
    r.add_argument("runs", nargs="+", help="JSON files written by compile")
    r.add_argument("--png", help="bar plot to write")
    r.add_argument("--json", help="merged JSON (seed figures + runs) to write")
    ns = parser.parse_args(argv)
    if ns.cmd == "compile":
        if not aot_flags:
            parser.error("compile: the pdjax.aot flags follow `--`")
        return cmd_compile(ns, aot_flags)
    return cmd_report(ns)


if __name__ == "__main__":
    sys.exit(main())
