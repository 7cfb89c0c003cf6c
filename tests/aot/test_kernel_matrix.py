"""The kernel matrix compiles each kernel over the cache layout the engine gives the platform
(``pallas_kernels/lanes.py``): on TPU the latent and indexer rows are whole lanes, elsewhere
they are as wide as the model's. No compiler needed: only the case arguments are checked."""

from pdjax.aot import kernel_matrix as km


def _case(kernel, model, kv_dtype="bfloat16"):
    return next(c for c in km.kernel_cases() if c.kernel == kernel and c.shape.model == model
                and c.shape.tp == 1 and c.page_size == 64 and c.bucket.name == "decode"
                and c.kv_dtype == kv_dtype)


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


def test_fp8_mla_cases_take_the_records_planes():
    """FP8 MLA cases: q [T, H, 576] unpadded, then the record's planes as the engine lays them
    out: GPU 512 e4m3 + 4 float32 + 64 bf16 (656 bytes a token), TPU 512 e4m3 + 128 bf16."""
    import jax.numpy as jnp
    for kernel in ("mla_dense", "mla_sparse"):
        case = _case(kernel, "deepseek-v3.2", "float8_e4m3fn")
        gpu = km.case_function(case, "gpu")[1]
        tpu = km.case_function(case, "tpu")[1]
        assert gpu[0][0][-1] == tpu[0][0][-1] == 576
        assert [(a[0][-1], jnp.dtype(a[1])) for a in gpu[1:4]] == [
            (512, jnp.float8_e4m3fn), (4, jnp.float32), (64, jnp.bfloat16)]
        assert [(a[0][-1], jnp.dtype(a[1])) for a in tpu[1:3]] == [
            (512, jnp.float8_e4m3fn), (128, jnp.bfloat16)]


def test_fp8_indexer_cases_take_keys_and_scales_on_gpu_bf16_keys_on_tpu():
    import jax.numpy as jnp
    case = _case("indexer", "deepseek-v3.2", "float8_e4m3fn")
    gpu = km.case_function(case, "gpu")[1]
    tpu = km.case_function(case, "tpu")[1]
    assert [(a[0][-1], jnp.dtype(a[1])) for a in gpu[2:4]] == [
        (128, jnp.float8_e4m3fn), (1, jnp.float32)]
    assert (tpu[2][0][-1], jnp.dtype(tpu[2][1])) == (128, jnp.bfloat16)
