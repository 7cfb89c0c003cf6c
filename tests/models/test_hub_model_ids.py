"""``--model-path org/name`` through huggingface_hub, against a local cache directory laid out
as the hub lays it out (no network here: HF_HUB_OFFLINE=1)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow      # starts processes (README: the fast tier starts none)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _snapshot(cache, repo_id, commit, files_from, refs=()):
    """models--org--name/{blobs,snapshots/<commit>,refs/<ref>} as huggingface_hub writes it
    (snapshot entries are symlinks into blobs/)."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    snap = os.path.join(repo, "snapshots", commit)
    os.makedirs(snap, exist_ok=True)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    for name in os.listdir(files_from):
        blob = os.path.join(repo, "blobs", f"{commit[:8]}-{name}")
        shutil.copyfile(os.path.join(files_from, name), blob)
        os.symlink(os.path.relpath(blob, snap), os.path.join(snap, name))
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    for ref in refs:
        with open(os.path.join(repo, "refs", ref), "w") as f:
            f.write(commit)
    return snap


def _resolve(cache, model_path, revision=None):
    code = ("import json, sys\n"
            "from pdjax.models.checkpoint import resolve_model_path\n"
            "try:\n"
            f"    print(json.dumps({{'path': resolve_model_path({model_path!r}, {revision!r})}}))\n"
            "except ValueError as e:\n"
            "    print(json.dumps({'error': str(e)}))\n")
    env = dict(os.environ, HF_HUB_CACHE=cache, HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def hub_cache(tiny_checkpoints, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("hub"))
    a, b = "a" * 40, "b" * 40
    snaps = {
        "main": _snapshot(cache, "pdjax-test/tiny-llama", a, tiny_checkpoints["llama"], ["main"]),
        "v2": _snapshot(cache, "pdjax-test/tiny-llama", b, tiny_checkpoints["qwen2"], ["v2"]),
    }
    gguf_dir = str(tmp_path_factory.mktemp("gguf_src"))
    with open(os.path.join(gguf_dir, "model.Q4_1.gguf"), "wb") as f:
        f.write(b"GGUF")
    snaps["gguf"] = _snapshot(cache, "pdjax-test/tiny-gguf", "c" * 40, gguf_dir, ["main"])
    return cache, snaps


def test_model_id_resolves_to_the_cached_snapshot(hub_cache):
    cache, snaps = hub_cache
    assert _resolve(cache, "pdjax-test/tiny-llama") == {"path": snaps["main"]}
    assert _resolve(cache, "pdjax-test/tiny-llama", "v2") == {"path": snaps["v2"]}
    assert _resolve(cache, "pdjax-test/tiny-llama", "b" * 40) == {"path": snaps["v2"]}
    assert _resolve(cache, "pdjax-test/tiny-gguf") == {
        "path": os.path.join(snaps["gguf"], "model.Q4_1.gguf")}


def test_unknown_ids_and_revisions_are_clear_errors(hub_cache):
    cache, _ = hub_cache
    err = _resolve(cache, "pdjax-test/absent")["error"]
    assert err.startswith("pdjax-test/absent: not found locally")
    err = _resolve(cache, "pdjax-test/tiny-llama", "v9")["error"]
    assert err.startswith("pdjax-test/tiny-llama (revision v9): not found locally")
    err = _resolve(cache, "no/such/thing")["error"]
    assert "model path not found" in err


def test_a_model_id_loads_and_serves_its_snapshot(hub_cache, tiny_checkpoints):
    """The loader and the tokenizer take the id wherever they take a path."""
    cache, _ = hub_cache
    code = ("from pdjax.models.loader import load_model, load_tokenizer\n"
            "cfg, _ = load_model('pdjax-test/tiny-llama', progress=False)\n"
            "print(cfg.architecture, cfg.num_layers, "
            "len(load_tokenizer('pdjax-test/tiny-llama').encode('hello world')))\n")
    env = dict(os.environ, HF_HUB_CACHE=cache, HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True, timeout=300)
    from pdjax.model_config import ModelConfig
    from transformers import AutoTokenizer

    cfg = ModelConfig.from_hf_dir(tiny_checkpoints["llama"])
    n = len(AutoTokenizer.from_pretrained(tiny_checkpoints["llama"]).encode("hello world"))
    assert out.stdout.split() == [cfg.architecture, str(cfg.num_layers), str(n)]
