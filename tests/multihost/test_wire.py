"""The multi-host messages (``pdjax.distributed.wire``) and flags, without processes."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from pdjax.config import ServerArgs
from pdjax.distributed import wire


def test_arrays_round_trip_as_raw_bytes():
    for a in (np.arange(6, dtype=np.int32).reshape(2, 3), np.array([True, False]),
              np.array([[1, 2]], np.uint32), np.float32([0.5, -1.25]), np.zeros((0,), np.int32),
              np.bool_(True),
              np.arange(6, dtype=np.int32).reshape(2, 3).T):
        frame = wire.encode("forward", seq=1, a=wire.encode_array(a))
        b = wire.decode_array(wire.decode(frame)["a"], "a")
        assert b.dtype == a.dtype and b.shape == a.shape and (b == a).all()


@pytest.mark.parametrize("obj, needle", [
    ({"dtype": "object", "shape": [1], "data": b"x" * 8}, "dtype 'object'"),
    ({"dtype": "int32", "shape": [2], "data": b"\0" * 4}, "do not fill shape [2]"),
    ({"dtype": "int32", "shape": [-1], "data": b""}, "bad shape"),
    ({"dtype": "int32", "shape": [1, 1, 1, 1], "data": b"\0" * 4}, "bad shape"),
    ({"dtype": "int32", "shape": [1]}, "not an array"),
    ([1, 2], "not an array"),
])
def test_malformed_arrays_are_refused_by_name(obj, needle):
    with pytest.raises(wire.WireError, match="batch.input_ids") as e:
        wire.decode_array(obj, "batch.input_ids")
    assert needle in str(e.value)


def test_frames_that_are_not_messages_are_refused():
    with pytest.raises(wire.WireError, match="not a msgpack frame"):
        wire.decode(b"\xc1")
    with pytest.raises(wire.WireError, match="not a map"):
        wire.decode(msgpack.packb([1, 2]))
    with pytest.raises(wire.WireError, match="protocol version 99"):
        wire.decode(msgpack.packb({"v": 99, "op": "forward"}))
    with pytest.raises(wire.WireError, match="unknown op 'exec'"):
        wire.decode(msgpack.packb({"v": wire.PROTOCOL_VERSION, "op": "exec"}))


def test_integers_are_range_checked():
    msg = {"slot": 5, "ids": [1, 2, 700], "flag": True}
    assert wire.get_int(msg, "slot", 0, 6) == 5
    with pytest.raises(wire.WireError, match=r"slot: 5 is not an integer in \[0, 5\)"):
        wire.get_int(msg, "slot", 0, 5)
    with pytest.raises(wire.WireError, match="flag"):
        wire.get_int(msg, "flag", 0, 5)           # a bool is no integer here
    with pytest.raises(wire.WireError, match=r"ids: 700 is not an integer in \[0, 512\)"):
        wire.get_int_list(msg, "ids", 0, 512, 10)
    with pytest.raises(wire.WireError, match="at most 2"):
        wire.get_int_list(msg, "ids", 0, 1000, 2)


def test_identities_name_every_field_that_differs():
    a = ServerArgs(nnodes=2, node_rank=0, dist_init_addr="127.0.0.1:5000", tp_size=4)
    b = ServerArgs(nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:5000", tp_size=4, page_size=8,
                   max_running_requests=8)
    lead = wire.node_identity(a, "abc", "1.0")
    assert wire.identity_mismatches(lead, wire.node_identity(
        ServerArgs(nnodes=2, node_rank=1, dist_init_addr="h:1", tp_size=4), "abc", "1.0")) == []
    got = wire.identity_mismatches(lead, wire.node_identity(b, "abd", "1.1", "w2"))
    assert got == ["model: node 0 has 'abc', node 1 has 'abd'",
                   "weights: node 0 has '', node 1 has 'w2'",
                   "version: node 0 has '1.0', node 1 has '1.1'",
                   "page_size: node 0 has 16, node 1 has 8",
                   "max_running_requests: node 0 has 16, node 1 has 8"]


@pytest.mark.parametrize("kw, field", [
    (dict(nnodes=0), "nnodes"),
    (dict(nnodes=2, node_rank=2, dist_init_addr="h:1"), "node_rank"),
    (dict(node_rank=-1), "node_rank"),
    (dict(nnodes=2), "dist_init_addr"),
    (dict(nnodes=2, dist_init_addr="127.0.0.1"), "dist_init_addr"),
    (dict(nnodes=2, dist_init_addr="127.0.0.1:65535"), "dist_init_addr"),
    (dict(nnodes=2, dist_init_addr="h:1", role="decode",
          disaggregation_transfer_path="staging"), "disaggregation_transfer_path"),
    (dict(nnodes=2, dist_init_addr="h:1", role="prefill",
          disaggregation_transfer_path="staging"), "disaggregation_transfer_path"),
    (dict(nnodes=2, dist_init_addr="h:1", role="prefill", disaggregation_bootstrap_port=0),
     "disaggregation_bootstrap_port"),
    (dict(dist_timeout_s=0), "dist_timeout_s"),
])
def test_bad_node_flags_raise_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        ServerArgs(**kw)


def test_a_multi_host_decode_needs_no_bootstrap_port():
    args = ServerArgs(nnodes=2, dist_init_addr="h:1", role="decode",
                      disaggregation_bootstrap_port=0)
    assert (args.role, args.nnodes, args.disaggregation_bootstrap_port) == ("decode", 2, 0)


def test_node_flags_from_the_cli():
    from pdjax.serve import parse_args

    # TP 3 splits the default model (SmolLM2: 9 heads, 3 KV heads); its devices are counted
    # only once the nodes have joined.
    args = parse_args(["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:5000",
                       "--tp-size", "3"])
    assert (args.nnodes, args.node_rank, args.dist_init_addr) == (2, 1, "10.0.0.1:5000")
    with pytest.raises(SystemExit):       # heads TP 16 cannot split: refused before joining
        parse_args(["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:5000",
                    "--tp-size", "16"])


def test_weights_fingerprint_sees_sizes_sampled_bytes_and_names_only_of_weight_files(tmp_path):
    """Nodes that loaded different weights refuse to start (``identity_mismatches`` names
    ``weights``): a byte changed where it is sampled, a size, a file name; a tokenizer or
    config file that differs does not count (the config has its own digest)."""
    size = 3 * wire.WEIGHT_SAMPLE_BYTES + 100
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)

    def checkpoint(name, weights=data, weights_name="model.safetensors", tokenizer=b"{}"):
        d = tmp_path / name
        (d / "params").mkdir(parents=True)
        (d / weights_name).write_bytes(weights)
        (d / "tokenizer.json").write_bytes(tokenizer)
        (d / "params" / "_METADATA").write_bytes(name.encode())
        return str(d)

    base = wire.weights_fingerprint(checkpoint("a"))
    assert len(base) == 32 and wire.weights_fingerprint(checkpoint("b", tokenizer=b"[]")) == base
    mid = bytearray(data)
    mid[size // 2] ^= 1
    for name, kw in (("c", dict(weights=bytes(mid))), ("d", dict(weights=data[:-1])),
                     ("e", dict(weights_name="model-00001.safetensors"))):
        assert wire.weights_fingerprint(checkpoint(name, **kw)) != base, name
    single = tmp_path / "m.gguf"
    single.write_bytes(data)
    assert wire.weights_fingerprint(str(single)) != base
