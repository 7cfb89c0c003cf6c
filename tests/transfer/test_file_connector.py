"""A KV connector added without touching ``sched/`` or ``engine/``: a file-backed one.

The first engine saves the KV of every finished prompt's full pages to a file (its pages held
until the file is written: ``request_finished`` -> ``finished_sending``); the second reads
them into the pages it reserved (``get_num_new_matched_tokens`` -> ``finished_recving``) and
computes only the prompt's last page. Both must answer with the tokens a plain engine gives.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from pdjax.engine import Engine
from pdjax.pd.wire import prompt_digest
from pdjax.sched.kv_connector import KVConnectorOutput, NullConnector
from pdjax.transfer.factory import KVConnection, register_kv_connector, unregister_kv_connector
from pdjax.transfer.worker import KVTransferWorker

PAGE = 8


class FileConnector(NullConnector):
    """Saves (``save``) or loads the KV of a prompt's full pages in ``directory``, one
    ``.npz`` per prompt prefix, named by the digest of its tokens."""

    def __init__(self, directory: pathlib.Path, page_size: int, save: bool):
        self.dir, self.ps, self.save = directory, page_size, save
        self.to_save: list[tuple[str, pathlib.Path, list[int]]] = []
        self.to_load: list[tuple[str, pathlib.Path, int, list[int]]] = []
        self.calls: list[str] = []

    def path(self, ids) -> pathlib.Path:
        return self.dir / f"{prompt_digest(ids).hex()}.npz"

    def get_num_new_matched_tokens(self, req, num_computed_tokens):
        n = (req.num_prompt_tokens - 1) // self.ps * self.ps     # one token left to compute
        if self.save or n <= num_computed_tokens or not self.path(req.prompt_ids[:n]).exists():
            return 0
        return n - num_computed_tokens

    def update_state_after_alloc(self, req, num_external_tokens):
        if num_external_tokens:
            self.calls.append(f"load {req.rid}")
            n = num_external_tokens // self.ps
            first = len(req.pages) - n
            self.to_load.append((req.rid, self.path(req.prompt_ids[:(first + n) * self.ps]),
                                 first, req.pages[first:]))

    def request_finished(self, req):
        n = req.num_prompt_tokens // self.ps
        if not self.save or n == 0:
            return False
        self.calls.append(f"save {req.rid}")
        self.to_save.append((req.rid, self.path(req.prompt_ids[:n * self.ps]), req.pages[:n]))
        return True

    def build_meta(self, batch):
        meta = {"save": self.to_save, "load": self.to_load}
        self.to_save, self.to_load = [], []
        return meta if meta["save"] or meta["load"] else None


class FileWorker(KVTransferWorker):
    """Copies pages between the engine's KV cache and the files, at ``start`` (no thread)."""

    def __init__(self, runner):
        self.runner = runner
        self.done = KVConnectorOutput()
        self.pages_moved = 0

    def start(self, meta):
        for rid, path, pages in meta["save"]:
            parts = self.runner.gather_pages(np.asarray(pages, np.int32))
            np.savez(path, *parts)
            self.done.finished_sending.add(rid)
            self.pages_moved += len(pages)
        for rid, path, first, pages in meta["load"]:
            with np.load(path) as f:
                parts = [f[f"arr_{i}"][:, first:first + len(pages)] for i in range(len(f.files))]
            self.runner.scatter_pages(np.asarray(pages, np.int32), parts)
            self.done.finished_recving.add(rid)
            self.pages_moved += len(pages)

    def poll(self):
        done, self.done = self.done, KVConnectorOutput()
        return done

    def has_work(self):
        return bool(self.done)


@pytest.fixture(scope="module")
def file_engines(tiny_checkpoints, tmp_path_factory):
    directory = tmp_path_factory.mktemp("kv")
    made = {}

    def factory(save):
        def build(host):
            conn = FileConnector(directory, host.args.page_size, save)
            made["save" if save else "load"] = conn
            return KVConnection(conn, FileWorker(host.runner))
        return build

    register_kv_connector("test-file-save", factory(True))
    register_kv_connector("test-file-load", factory(False))
    kw = dict(dtype="float32", page_size=PAGE, max_total_tokens=1024, max_running_requests=4,
              chunked_prefill_size=64, context_length=128, progress=False)
    try:
        engines = {name: Engine(tiny_checkpoints["llama"], kv_connector=name, **kw)
                   for name in ("test-file-save", "test-file-load")}
        engines["plain"] = Engine(tiny_checkpoints["llama"], **kw)
        yield engines, made
    finally:
        unregister_kv_connector("test-file-save")
        unregister_kv_connector("test-file-load")


def test_a_second_engine_reads_the_prompt_kv_from_a_file_instead_of_computing_it(file_engines):
    engines, made = file_engines
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, 250, n)] for n in (21, 35)]
    sp = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    plain = engines["plain"].generate(input_ids=prompts, sampling_params=sp)
    want = [o["output_ids"] for o in plain]

    saver = engines["test-file-save"]
    got = [o["output_ids"] for o in saver.generate(input_ids=prompts, sampling_params=sp)]
    assert got == want
    saver.generate(input_ids=[[5]], sampling_params=sp)   # a step after the last finish
    assert sorted(p.name for p in made["save"].dir.iterdir()) == sorted(
        f"{prompt_digest(p[:len(p) // PAGE * PAGE]).hex()}.npz" for p in prompts)
    core = saver.core
    assert not core.scheduler.held and core.kv_worker.pages_moved == 2 + 4
    core.scheduler.check_invariants()

    loader = engines["test-file-load"]
    core = loader.core
    before = core.scheduler.num_prompt_tokens_computed
    outs = loader.generate(input_ids=prompts, sampling_params=sp)
    assert [o["output_ids"] for o in outs] == want
    # 21 tokens: 2 pages (16 tokens) read, 5 computed; 35: 4 pages read, 3 computed.
    assert core.scheduler.num_prompt_tokens_computed - before == 5 + 3
    assert core.kv_worker.pages_moved == 2 + 4
    assert len(made["load"].calls) == 2 and all(c.startswith("load ") for c in made["load"].calls)
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [16, 32]
    assert not core.scheduler.waiting_remote
    core.scheduler.check_invariants()


def test_an_unknown_kv_connector_is_refused_before_anything_loads(capsys):
    """The registry lives with the builder (``transfer/factory``), not in ``config``: serve's
    parse step and the engine check the name before a model loads."""
    from pdjax.config import ServerArgs
    from pdjax.engine.core import EngineCore
    from pdjax.serve import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--port", "0", "--kv-connector", "nope"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: kv_connector: 'nope' is not registered (known: ")
    assert err.count("\n") == 1, err
    with pytest.raises(ValueError, match=r"^kv_connector: 'nope' is not registered"):
        EngineCore(ServerArgs(kv_connector="nope", model_path="/nonexistent/checkpoint"))
