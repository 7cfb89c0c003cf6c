"""The kernel matrix compiles each kernel over the cache layout the engine gives the platform
(``pallas_kernels/lanes.py``): on TPU the latent and indexer rows are whole lanes, elsewhere
they are as wide as the model's. No compiler needed: only the case arguments are checked."""

from pdjax.aot import kernel_matrix as km


def _case(kernel, model):
    return next(c for c in km.kernel_cases() if c.kernel == kernel and c.shape.model == model
                and c.shape.tp == 1 and c.page_size == 64 and c.bucket.name == "decode")


def test_cases_use_the_engines_cache_rows():
    mla, idx, rpa = (_case("mla_sparse", "deepseek-v3.2"), _case("indexer", "deepseek-v3.2"),
                     _case("rpa", "llama3-8b"))
    tpu = {k: km.case_function(c, "tpu")[1] for k, c in (("mla", mla), ("idx", idx),
                                                            ("rpa", rpa))}
    gpu = {k: km.case_function(c, "gpu")[1] for k, c in (("mla", mla), ("idx", idx),
                                                            ("rpa", rpa))}
    # MLA: q [T, H, 576] against a latent pool of 640-lane rows on TPU, 576 on GPU.
    assert tpu["mla"][0][0][-1] == gpu["mla"][0][0][-1] == 576
    assert tpu["mla"][1][0][-1] == 640 and gpu["mla"][1][0][-1] == 576
    # The indexer's 128-wide keys are whole lanes already; GQA rows are KVH * D = 8 * 128.
    assert tpu["idx"][2][0][-1] == gpu["idx"][2][0][-1] == 128
    assert tpu["rpa"][1][0] == gpu["rpa"][1][0] == (32, 65536 // 64 + 1, 64, 1024)
