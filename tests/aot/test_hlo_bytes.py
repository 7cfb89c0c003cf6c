"""``pdjax.aot.hlo_bytes`` counts the bytes of every collective of a compiled executable: a
hand-made shard_map program with one of each kind (and a loop of known trip count) compiled
on the CPU devices, and a hand-written GPU-style HLO text (async pairs, the three
``replica_groups`` spellings, ``ragged-all-to-all``, a conditional, nested loops), each to
the exact byte."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from pdjax.aot.hlo_bytes import KINDS, collective_bytes, collectives, group_size, shape_bytes

N = 4                                   # tests/conftest.py's CPU devices


def _buffer(result, kind):
    return result["total"][kind]["buffer_bytes"]


def test_compiled_cpu_program_exact_bytes():
    assert len(jax.devices()) >= N, f"tests/conftest.py gives the suite {N} CPU devices"
    mesh = jax.make_mesh((N,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    rows, width = 8, 16                             # one device's f32 block: 512 bytes
    block = rows * width * 4

    def body(a):
        g = jax.lax.all_gather(a, "x")                                       # [N, 8, 16]
        s = jax.lax.psum_scatter(g, "x", scatter_dimension=0, tiled=True)    # [1, 8, 16]
        t = jax.lax.all_to_all(a, "x", 0, 0, tiled=True)
        p = jax.lax.ppermute(a, "x", [(i, (i + 1) % N) for i in range(N)])
        r = jax.lax.fori_loop(0, 5, lambda i, c: c + jax.lax.psum(c * 2, "x"), a)
        return s[0] + t + p + r

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = jax.ShapeDtypeStruct((N * rows, width), jnp.float32,
                             sharding=NamedSharding(mesh, P("x")))
    result = collective_bytes(f.lower(x).compile().as_text())
    total = result["total"]
    assert _buffer(result, "all-gather") == N * block                   # the gathered buffer
    assert total["all-gather"]["sent_bytes"] == (N - 1) * block
    assert _buffer(result, "reduce-scatter") == N * block
    assert total["reduce-scatter"]["sent_bytes"] == (N - 1) * block
    assert _buffer(result, "all-to-all") == block
    assert _buffer(result, "collective-permute") == block
    # The psum runs once per iteration of the 5-trip loop.
    assert total["all-reduce"]["count"] == 5
    assert _buffer(result, "all-reduce") == 5 * block
    assert total["all-reduce"]["sent_bytes"] == 5 * 2 * block * (N - 1) // N
    assert [(lp["trip_count"], lp["per_iteration"]["all-reduce"]["buffer_bytes"])
            for lp in result["loops"]] == [(5, block)]
    assert result["unknown_trip_counts"] == []


# A GPU-style module: async collectives, XLA's three replica_groups spellings, a layer loop
# of 61 trips holding a nested 2-trip loop, a ragged all-to-all behind async-start, and a
# conditional whose larger branch counts.
HLO = """HloModule jit_step, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%ragged_body (p0: bf16[64,128], p1: bf16[64,128], p2: s32[8], p3: s32[8], p4: s32[8], \
p5: s32[8]) -> bf16[64,128] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[64,128]{1,0} parameter(1)
  %p2 = s32[8]{0} parameter(2)
  %p3 = s32[8]{0} parameter(3)
  %p4 = s32[8]{0} parameter(4)
  %p5 = s32[8]{0} parameter(5)
  ROOT %ra = bf16[64,128]{1,0} ragged-all-to-all(%p0, %p1, %p2, %p3, %p4, /*index=5*/%p5), \
channel_id=9, replica_groups=[1,8]<=[8]
}

%inner (ip: (s32[], f32[16])) -> (s32[], f32[16]) {
  %ip = (s32[], f32[16]{0}) parameter(0)
  %iv = f32[16]{0} get-tuple-element(%ip), index=1
  %ar-start = f32[16]{0} all-reduce-start(%iv), channel_id=3, \
replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, to_apply=%add
  %ar-done = f32[16]{0} all-reduce-done(%ar-start)
  %ic = s32[] get-tuple-element(%ip), index=0
  ROOT %it = (s32[], f32[16]{0}) tuple(%ic, %ar-done)
}

%inner_cond (ic: (s32[], f32[16])) -> pred[] {
  %ic = (s32[], f32[16]{0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

%layer (lp: (s32[], bf16[2,7168])) -> (s32[], bf16[2,7168]) {
  %lp = (s32[], bf16[2,7168]{1,0}) parameter(0)
  %x = bf16[2,7168]{1,0} get-tuple-element(%lp), index=1
  %ag-start = (bf16[2,7168]{1,0}, bf16[16,7168]{1,0}) all-gather-start(%x), channel_id=1, \
replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, \
metadata={op_name="jit(step)/while/body/all_gather"}
  %ag-done = bf16[16,7168]{1,0} all-gather-done(%ag-start)
  %rs-start = ((bf16[16,7168]{1,0}), bf16[2,7168]{1,0}) reduce-scatter-start(%ag-done), \
channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
  %rs-done = bf16[2,7168]{1,0} reduce-scatter-done(%rs-start)
  %z = f32[16]{0} broadcast(), dimensions={}
  %t0 = (s32[], f32[16]{0}) tuple(%z, %z)
  %w2 = (s32[], f32[16]{0}) while(%t0), condition=%inner_cond, body=%inner, \
backend_config={"known_trip_count":{"n":"2"}}
  %c = s32[] get-tuple-element(%lp), index=0
  ROOT %lt = (s32[], bf16[2,7168]{1,0}) tuple(%c, %rs-done)
}

%layer_cond (lc: (s32[], bf16[2,7168])) -> pred[] {
  %lc = (s32[], bf16[2,7168]{1,0}) parameter(0)
  ROOT %t = pred[] constant(true)
}

%cond_big (bp: f32[1024]) -> f32[1024] {
  %bp = f32[1024]{0} parameter(0)
  ROOT %bar = f32[1024]{0} all-reduce(%bp), replica_groups={}, to_apply=%add
}

%cond_small (sp: f32[4]) -> f32[4] {
  %sp = f32[4]{0} parameter(0)
  ROOT %sar = f32[4]{0} all-reduce(%sp), replica_groups={}, to_apply=%add
}

ENTRY %main (x0: bf16[2,7168], q: pred[], big: f32[1024], small: f32[4], r0: bf16[64,128], \
r1: bf16[64,128], c: s32[8]) -> bf16[2,7168] {
  %x0 = bf16[2,7168]{1,0} parameter(0)
  %q = pred[] parameter(1)
  %big = f32[1024]{0} parameter(2)
  %small = f32[4]{0} parameter(3)
  %r0 = bf16[64,128]{1,0} parameter(4)
  %r1 = bf16[64,128]{1,0} parameter(5)
  %cnt = s32[8]{0} parameter(6)
  %k = s32[] constant(0)
  %t = (s32[], bf16[2,7168]{1,0}) tuple(%k, %x0)
  %w = (s32[], bf16[2,7168]{1,0}) while(%t), condition=%layer_cond, body=%layer, \
backend_config={"known_trip_count":{"n":"61"},"known_init_step":{"init":"0","step":"1"}}
  %cond = f32[4]{0} conditional(%q, %big, %small), true_computation=%cond_big, \
false_computation=%cond_small
  %as = ((bf16[64,128]{1,0}, bf16[64,128]{1,0}, s32[8]{0}, s32[8]{0}, s32[8]{0}, s32[8]{0}), \
bf16[64,128]{1,0}) async-start(%r0, %r1, %cnt, %cnt, %cnt, %cnt), calls=%ragged_body
  %ad = bf16[64,128]{1,0} async-done(%as), calls=%ragged_body
  %cp-start = (bf16[2,7168]{1,0}, bf16[2,7168]{1,0}, u32[], \
u32[]) collective-permute-start(%x0), channel_id=5, source_target_pairs={{0,1},{1,0}}
  %cp-done = bf16[2,7168]{1,0} collective-permute-done(%cp-start)
  ROOT %out = bf16[2,7168]{1,0} get-tuple-element(%w), index=1
}
"""


def test_handwritten_hlo_exact_bytes():
    result = collective_bytes(HLO)
    total = result["total"]
    row = 2 * 7168 * 2                                          # bf16[2,7168]: 28,672 bytes
    assert result["num_partitions"] == 8
    # One DP-gather-like all-gather and one reduce-scatter per layer, 61 layers.
    assert total["all-gather"] == {"count": 61, "buffer_bytes": 61 * 8 * row,
                                   "sent_bytes": 61 * 7 * row}
    assert total["reduce-scatter"] == {"count": 61, "buffer_bytes": 61 * 8 * row,
                                       "sent_bytes": 61 * 7 * row}
    # The inner loop's all-reduce (group of 4 on the mesh axis) runs 61 x 2 times; the
    # conditional counts its larger branch, the f32[1024] all-reduce over all 8 devices.
    assert total["all-reduce"]["count"] == 61 * 2 + 1
    assert total["all-reduce"]["buffer_bytes"] == 61 * 2 * 64 + 4096
    assert total["all-reduce"]["sent_bytes"] == 61 * 2 * (2 * 64 * 3 // 4) + 2 * 4096 * 7 // 8
    # The ragged exchange counts its send buffer once (not again at async-done).
    assert total["ragged-all-to-all"] == {"count": 1, "buffer_bytes": 64 * 128 * 2,
                                          "sent_bytes": 64 * 128 * 2 * 7 // 8}
    assert total["collective-permute"]["buffer_bytes"] == row
    assert total["all-to-all"]["count"] == 0
    loops = {lp["name"]: lp for lp in result["loops"]}
    assert loops["w"]["trip_count"] == 61
    assert loops["w"]["per_iteration"]["all-gather"]["buffer_bytes"] == 8 * row
    assert loops["w"]["per_iteration"]["all-reduce"]["buffer_bytes"] == 2 * 64
    assert loops["w"]["op_name"] == "jit(step)/while/body/all_gather"
    assert loops["w2"]["trip_count"] == 2
    assert result["unknown_trip_counts"] == []
    assert sorted(c.kind for c in collectives(HLO)) == sorted(
        ["all-gather", "reduce-scatter", "all-reduce", "all-reduce", "all-reduce",
         "ragged-all-to-all", "collective-permute"])


def test_loop_without_trip_count_is_reported():
    text = HLO.replace('backend_config={"known_trip_count":{"n":"61"},', "backend_config={")
    result = collective_bytes(text)
    assert result["unknown_trip_counts"] == ["w"]
    assert result["total"]["all-gather"]["count"] == 1


@pytest.mark.parametrize("line, n", [
    ("replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}", 4),
    ("replica_groups=[2,4]<=[8]", 4),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", 2),
    ("replica_groups=mesh['a'=2,'b'=4] {'a','b'}", 8),
    ("replica_groups={}", 8),
    ("channel_id=1", 8),
])
def test_group_size_spellings(line, n):
    assert group_size(line, 8) == n


def test_shape_bytes_and_bad_input():
    assert shape_bytes("(bf16[8,256]{1,0}, f8e4m3fn[4,4], s4[3])") == 8 * 256 * 2 + 16 + 2
    assert shape_bytes("f32[]") == 4
    with pytest.raises(ValueError, match="dtype"):
        shape_bytes("q7[4]")
    with pytest.raises(ValueError, match="ENTRY"):
        collective_bytes("HloModule m\n\n%f (a: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n}\n")
    assert set(KINDS) == {"all-gather", "reduce-scatter", "all-reduce", "all-to-all",
                          "ragged-all-to-all", "collective-permute"}


def _script():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench_step_bytes.py")
    spec = importlib.util.spec_from_file_location("bench_step_bytes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_layer_loop_and_bad_flags(capsys):
    script = _script()
    # The layer scan is the loop of most trips up to the model's layers (not a 5-trip inner
    # loop nor a longer unrelated one), and the table gives its per-iteration bytes.
    step = {"bucket": {"entry": "extend", "num_tokens": 64, "num_rows": 4, "pages_per_seq": 2},
            "total": collective_bytes(HLO)["total"], "loops": [
                {"trip_count": 3, "per_iteration": {k: {"buffer_bytes": 1} for k in KINDS}},
                {"trip_count": 58, "per_iteration": {k: {"buffer_bytes": 2} for k in KINDS}},
                {"trip_count": 100, "per_iteration": {k: {"buffer_bytes": 3} for k in KINDS}}]}
    run = {"label": "L", "model": "m", "dp_attention": 1, "num_layers": 61,
           "mixed": step, "decode": step}
    rows = script.summarize(run)
    assert [r["layer_trip"] for r in rows] == [58, 58]
    assert rows[0]["per_layer"]["all-gather"] == 2
    assert rows[0]["per_step"]["all-gather"] == 61 * 8 * 2 * 7168 * 2
    assert "| m | L | decode (extend T=64) |" in script.format_table(rows)
    assert script.main(["compile", "--label", "x", "--out", "/dev/null",
                        "--prefill-tokens", "-1", "--", "--gpu", "h200"]) == 2
    assert capsys.readouterr().err.strip() == "error: prefill_tokens: must be >= 0, got -1"
