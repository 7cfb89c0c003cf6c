"""notebooks/bucket_shapes.ipynb executes cleanly (nbclient) and its figures are sane."""

import pytest
import json
import os

import nbclient
import nbformat

from bench_settings import ROOT

from pdjax.sched.buckets import Buckets

pytestmark = pytest.mark.slow      # starts processes (README: the fast tier starts none)

NOTEBOOK = os.path.join(ROOT, "notebooks", "bucket_shapes.ipynb")


def test_bucket_shapes_notebook_executes(tmp_path, monkeypatch):
    summary = tmp_path / "summary.json"
    monkeypatch.setenv("BUCKET_SHAPES_JSON", str(summary))     # the kernel inherits it
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 2       # two figures
    data = json.loads(summary.read_text())
    res = {(r["trace"], r["bucket_set"]): r for r in data["results"]}
    sets = {"default", "pages x2", "one token bucket", "tokens +32", "exact"}
    assert {b for _, b in res} == sets and {t for t, _ in res} == {"mixed on", "mixed off"}
    assert (data["chunked_prefill_size"], data["max_running_requests"]) == (256, 16)
    kw = dict(chunked_prefill_size=256, max_running_requests=16,
              max_pages_per_seq=data["context_length"] // data["page_size"])
    for trace in ("mixed on", "mixed off"):
        d, one, fine = res[(trace, "default")], res[(trace, "one token bucket")], res[(trace, "tokens +32")]
        assert d["warmup_compiles"] == len(Buckets.create(**kw).all_keys())
        assert one["warmup_compiles"] == len(Buckets.create(**kw, min_tokens=256).all_keys())
        assert res[(trace, "pages x2")]["warmup_compiles"] == len(
            Buckets.create(**kw, pages_growth=2).all_keys())
        assert one["warmup_compiles"] < d["warmup_compiles"] < fine["warmup_compiles"]
        # fewer token buckets: fewer compiles, more padding
        assert one["token_waste"] > d["token_waste"] > fine["token_waste"] > 0
        assert res[(trace, "exact")]["token_waste"] == 0
        assert res[(trace, "exact")]["warmup_compiles"] > d["warmup_compiles"]
        assert res[(trace, "pages x2")]["page_table_waste"] <= d["page_table_waste"]
