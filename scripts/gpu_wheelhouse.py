"""The pure-Python wheels ``scripts/gpu_check.sh`` needs on a GPU host that has no package
registry: built here, carried with the tree, installed there for what is missing.

The GPU host has jax (CUDA), flax, orbax, aiohttp, msgpack, prometheus-client, tokenizers and
transformers (so numpy, tqdm, safetensors, huggingface_hub, pyyaml too). The engine check
needs nothing more (``load_format="dummy"``: no GGUF, no safetensors; a colocated engine
never imports ZMQ, which is not pure Python anyway); the kernel tests need pytest.

    python scripts/gpu_wheelhouse.py build [DIR]          (default DIR: .wheelhouse, ignored
                                                            by git; travels with the tree as
                                                            an extra path, e.g. run's carry)
    python scripts/gpu_wheelhouse.py install DIR SITE     (on the GPU host)

``build`` downloads ``WHEELS`` for CPython 3.12 on manylinux x86_64 with
``pip download --only-binary :all: --no-deps`` and refuses any wheel that is not pure Python
(``*-none-any.whl``). ``install`` installs, for each module of ``WHEELS`` that does not import,
its wheel from DIR into SITE (``pip install --no-index --no-deps --target``, or, without pip,
the wheel unpacked: a pure wheel is a zip of its files); only missing modules, so nothing the
host has is shadowed. Put SITE on ``PYTHONPATH`` afterwards. Exit status 1, naming the
modules, when one is missing and DIR has no wheel for it.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import re
import subprocess
import sys
import zipfile

# (import name, requirement): pytest and the dependencies it has beyond the host's packages.
WHEELS = (
    ("pytest", "pytest>=8,<10"),
    ("pluggy", "pluggy>=1.5,<2"),
    ("iniconfig", "iniconfig>=1"),
    ("packaging", "packaging>=20"),
    ("pygments", "pygments>=2.7.2"),
)
TARGET = dict(python_version="3.12", platform="manylinux2014_x86_64", implementation="cp")


def _dist_name(requirement: str) -> str:
    """``"pytest>=8,<10"`` -> ``"pytest"`` (normalized as wheel file names spell it)."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_for(folder: str, requirement: str) -> str | None:
    """The newest wheel of ``requirement``'s distribution in ``folder``, or None."""
    name = _dist_name(requirement)
    found = [p for p in glob.glob(os.path.join(folder, "*.whl"))
             if _dist_name(os.path.basename(p).split("-")[0]) == name]
    return sorted(found)[-1] if found else None


def build(folder: str, wheels=WHEELS) -> list[str]:
    """Download ``wheels`` into ``folder``; ``RuntimeError`` for a wheel that is not pure."""
    os.makedirs(folder, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary", ":all:", "--no-deps",
           "--python-version", TARGET["python_version"], "--platform", TARGET["platform"],
           "--implementation", TARGET["implementation"], "-d", folder,
           *[req for _, req in wheels]]
    subprocess.run(cmd, check=True)
    paths = [wheel_for(folder, req) for _, req in wheels]
    impure = [os.path.basename(p) for p in paths if p is None or not p.endswith("-none-any.whl")]
    if impure:
        raise RuntimeError(f"not pure-Python wheels (or missing): {impure}")
    return paths


def missing_modules(wheels=WHEELS) -> list[tuple[str, str]]:
    return [(mod, req) for mod, req in wheels if importlib.util.find_spec(mod) is None]


def _has_pip() -> bool:
    return subprocess.run([sys.executable, "-m", "pip", "--version"],
                          capture_output=True).returncode == 0


def install(folder: str, site: str, wheels=WHEELS, use_pip: bool | None = None) -> list[str]:
    """Install the wheels of the modules of ``wheels`` that do not import into ``site``.
    Returns the wheel files installed; ``RuntimeError`` naming the modules without a wheel."""
    need = missing_modules(wheels)
    if not need:
        return []
    paths = {mod: wheel_for(folder, req) for mod, req in need}
    lacking = sorted(mod for mod, path in paths.items() if path is None)
    if lacking:
        raise RuntimeError(f"modules {lacking} are missing and {folder!r} has no wheel for "
                           f"them: run 'python scripts/gpu_wheelhouse.py build {folder}' on a "
                           f"machine with a package index and bring the folder along")
    files = sorted(set(paths.values()))
    os.makedirs(site, exist_ok=True)
    if use_pip if use_pip is not None else _has_pip():
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps",
                        "--find-links", folder, "--target", site, "--quiet", *files], check=True)
    else:
        for path in files:
            with zipfile.ZipFile(path) as whl:
                whl.extractall(site)
    return files


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="download the wheels (needs a package index)")
    b.add_argument("folder", nargs="?", default=".wheelhouse")
    i = sub.add_parser("install", help="install the wheels of the missing modules")
    i.add_argument("folder")
    i.add_argument("site")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            for path in build(args.folder):
                print(path)
            return 0
        files = install(args.folder, args.site)
    except RuntimeError as e:
        print(f"gpu_wheelhouse: {e}", file=sys.stderr)
        return 1
    print("gpu_wheelhouse: " + (f"installed {', '.join(map(os.path.basename, files))} into "
                                f"{args.site}" if files else "every module is there"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
