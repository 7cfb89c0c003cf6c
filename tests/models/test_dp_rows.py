"""``models/dp_rows.py``: rows written at each rank's own slots of a page-sharded DP buffer
land on that rank's pages only, on every device of the rank, and read back in the stream's
order (4 simulated CPU devices; DP 4 of one device, DP 2 of two)."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

from pdjax.models.dp_attention import PAGE_SPEC
from pdjax.models.dp_rows import dp_read_rows, dp_write_rows

NP, PS, TS, D, W = 5, 4, 6, 3, 4      # pages a device, page size, tokens a rank, row width, lanes


@pytest.mark.parametrize("dp", [4, 2])
def test_rows_land_on_their_ranks_pages_and_read_back(dp):
    assert jax.device_count() >= 4
    tp, a = 4, 4 // dp
    cfg = types.SimpleNamespace(dp_size=dp, attn_tp_size=a)     # all that dp_rows reads
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    rng = np.random.default_rng(dp)
    # rank r writes Ts rows at distinct slots of its own pages 1..NP-1 (page 0: its null page)
    slots = np.stack([rng.choice(np.arange(PS, NP * PS), TS, replace=False)
                      for _ in range(dp)]).astype(np.int32)                     # [dp, Ts]
    rows = rng.standard_normal((dp * TS, D)).astype(np.float32)
    buf = jax.device_put(jnp.zeros((2, tp * NP, PS, W), jnp.float32),
                         NamedSharding(mesh, PAGE_SPEC))
    write = jax.jit(lambda b, r, s: dp_write_rows(cfg, b, 1, r, s))
    read = jax.jit(lambda b, s: dp_read_rows(cfg, b, 1, s))
    out = write(buf, rows, slots)
    assert out.sharding.spec == PAGE_SPEC
    want = np.zeros((2, tp * NP, PS, W), np.float32)
    for r in range(dp):
        for j in range(a):                      # every device of the rank holds a copy
            base = (r * a + j) * NP
            for t, s in enumerate(slots[r]):
                want[1, base + s // PS, s % PS, :D] = rows[r * TS + t]
    np.testing.assert_array_equal(np.asarray(out), want)
    got = np.asarray(read(out, slots))
    np.testing.assert_array_equal(got[:, :D], rows)
    assert not got[:, D:].any()
    with pytest.raises(ValueError, match="slot_mapping"):
        dp_write_rows(cfg, buf, 1, rows, slots.reshape(-1))
