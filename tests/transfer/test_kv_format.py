"""The KV format in the PD handshake (issue 40): each side names its KV cache's dtype or FP8
record (``cache_spec.kv_format``) in ``kv_dtype``; a prefill and a decode whose formats differ
are refused at pairing, before any byte moves, with both formats named."""

import dataclasses
import os
import re
import threading

import jax.numpy as jnp
import numpy as np
import pytest

from pdjax.models.cache_spec import CacheBufferSpec, gqa_cache_spec, kv_format
from pdjax.models.deepseek import deepseek_cache_spec
from pdjax.models.loader import checkpoint_config, make_mesh
from pdjax.pd.bootstrap import IncompatiblePeerError, PrefillServerInfo, check_compatible
from pdjax.pd.protocol import PROTOCOL_VERSION, RegisterDecode
from pdjax.runner.entry_points import EntryPoints
from pdjax.runner.model_runner import ModelRunner
from pdjax.transfer.decode_peer import DecodePeer
from pdjax.transfer.fake import FakeTransferEngine
from pdjax.transfer.local_kv import LocalKV

CKPT = os.path.join(os.path.dirname(__file__), "..", ".checkpoints", "deepseek_v32")
PS = 4


def _real_size():
    """DeepSeek-V3.2's MLA and indexer widths on the tiny model's config."""
    return dataclasses.replace(checkpoint_config(CKPT), kv_lora_rank=512, qk_rope_head_dim=64,
                               index_head_dim=128)


def test_kv_format_names_dtype_or_record():
    cfg = _real_size()
    assert kv_format(gqa_cache_spec(2, 2, 8, num_pages=4, page_size=PS,
                                    dtype=jnp.bfloat16)) == "bfloat16"
    # GQA fp8: e4m3 K/V with a float32 scale per token per KV head (2 x (2 x 8 + 2 x 4) B).
    assert kv_format(gqa_cache_spec(2, 2, 8, num_pages=4, page_size=PS,
                                    dtype=jnp.float8_e4m3fn)) == "fp8:gqa48"
    assert kv_format(deepseek_cache_spec(cfg, num_pages=4, page_size=PS,
                                         dtype=jnp.bfloat16)) == "bfloat16"
    gpu = kv_format(deepseek_cache_spec(cfg, num_pages=4, page_size=PS,
                                        dtype=jnp.float8_e4m3fn))
    tpu = kv_format(deepseek_cache_spec(cfg, num_pages=4, page_size=PS,
                                        dtype=jnp.float8_e4m3fn, row_align=128))
    assert gpu == "fp8:mla656+idx132"          # FlashMLA's record, FP8 indexer keys
    assert tpu == "fp8:mla768+bfloat16"        # the TPU split, bf16 indexer keys
    # MTP's hidden-state buffer stays in the model dtype; the name stays under the wire limit.
    mtp = CacheBufferSpec("mtp_hidden", (1, 4, PS, 7168), jnp.dtype(jnp.float32))
    specs = deepseek_cache_spec(cfg, num_pages=4, page_size=PS, dtype=jnp.float8_e4m3fn)
    assert kv_format(specs + (mtp,)) == "fp8:mla656+idx132+float32"
    many = tuple(CacheBufferSpec(f"x{i}", (1, 4, PS, 8), jnp.dtype(d)) for i, d in enumerate(
        (jnp.int8, jnp.int16, jnp.int32, jnp.uint8, jnp.uint16)))
    with pytest.raises(ValueError, match="specs: KV format .* longer than 32"):
        kv_format(specs + many)


class _MlaRunner(ModelRunner):
    """The runner's KV-page methods over the tiny DeepSeek-V3.2's cache buffers (no model)."""

    def __init__(self, dtype):
        self.cache_specs = deepseek_cache_spec(checkpoint_config(CKPT), num_pages=8,
                                               page_size=PS, dtype=dtype)
        self.jits = EntryPoints(None, make_mesh(1), self.cache_specs, max_rows=1, vocab_size=1,
                                page_size=PS)
        rng = np.random.default_rng(0)
        self.caches = {s.name: jnp.asarray(rng.standard_normal(s.shape), s.dtype)
                       for s in self.cache_specs}
        self.kv_copying, self.in_place_kv_required = {}, False
        self._kv_copy_lock = threading.Lock()


def _register(local_kv: LocalKV) -> RegisterDecode:
    return RegisterDecode(
        decode_engine_id="d0", reply_endpoint="tcp://127.0.0.1:1", engine_session_id="s",
        tp_rank=0, tp_size=1, kv_buffers=local_kv.layout.buffers, kv_layout="layer_major",
        metadata_addr=1 << 30, metadata_bytes_per_slot=64, metadata_num_slots=4, page_size=PS,
        kv_dtype=local_kv.kv_dtype, layout_fingerprint=local_kv.fingerprint)


def test_mismatched_kv_formats_are_refused_naming_both():
    """An FP8-record prefill and a bf16 decode (and the reverse) do not pair: the decode's
    bootstrap check and the prefill's registration check both refuse, naming both formats;
    equal formats pair, and the record's planes are registered as they are."""
    fp8 = LocalKV(_MlaRunner(jnp.float8_e4m3fn), FakeTransferEngine(), "direct")
    bf16 = LocalKV(_MlaRunner(jnp.bfloat16), FakeTransferEngine(), "direct")
    # tiny: latent 32 e4m3 + 4 B scale + 16 bf16; indexer keys 32 e4m3 + 4 B scale
    assert fp8.kv_dtype == "fp8:mla68+idx36"
    assert bf16.kv_dtype == "bfloat16"
    assert len(fp8.layout.buffers) == 5          # latent, scale, rope, indexer keys, scale
    assert fp8.bytes_per_page == 3 * PS * 68 + 3 * PS * 36
    for prefill, decode in ((fp8, bf16), (bf16, fp8)):
        with pytest.raises(ValueError, match=re.escape(
                f"prefill refuses to pair: kv_dtype: prefill '{prefill.kv_dtype}' != decode "
                f"'{decode.kv_dtype}'")):
            DecodePeer.from_registration(_register(decode), prefill, PS, 64)
        info = PrefillServerInfo(tp_size=1, page_size=PS, kv_dtype=prefill.kv_dtype,
                                 layout_fingerprint=prefill.fingerprint,
                                 protocol_version=PROTOCOL_VERSION, ranks=())
        with pytest.raises(IncompatiblePeerError, match=re.escape(
                f"kv_dtype: prefill '{prefill.kv_dtype}' != decode '{decode.kv_dtype}'")):
            check_compatible(info, page_size=PS, kv_dtype=decode.kv_dtype,
                             layout_fingerprint=decode.fingerprint)
    peer = DecodePeer.from_registration(
        _register(LocalKV(_MlaRunner(jnp.float8_e4m3fn), FakeTransferEngine(), "direct")),
        fp8, PS, 64)
    assert len(peer.layout.buffers) == 5
