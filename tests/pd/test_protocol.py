"""Control-plane messages: round trips, and rejection of malformed or out-of-range frames."""

import msgpack
import numpy as np
import pytest

from pdjax.pd import protocol as P
from pdjax.pd import wire as W
from pdjax.pd.kv_buffers import KVBufferDesc
from pdjax.pd.lifecycle import IllegalTransition, KVPoll
from pdjax.pd.protocol import (Abort, AbortAck, Heartbeat, ProtocolError, RegisterDecode,
                               RegisterResult, TransferRequest, TransferStatus, decode_message,
                               encode_message)
from pdjax.pd.wire import find_duplicates, prompt_digest, validate_pages


def _register(**over):
    fields = dict(
        decode_engine_id="decode-1", reply_endpoint="tcp://127.0.0.1:5001",
        engine_session_id="127.0.0.1:16000", tp_rank=0, tp_size=1,
        kv_buffers=(KVBufferDesc((0x7F0000001000,), 30, 513, 6144),
                    KVBufferDesc((0x7F0001001000,), 30, 513, 6144)),
        kv_layout="layer_major", metadata_addr=0x7F0002000000, metadata_bytes_per_slot=192,
        metadata_num_slots=64, page_size=16, kv_dtype="bfloat16", layout_fingerprint="ab12cd34")
    fields.update(over)
    return RegisterDecode(**fields)


ALL_MESSAGES = [
    _register(),
    _register(tp_rank=1, tp_size=2,
              kv_buffers=(KVBufferDesc((1 << 40, (1 << 40) + 4096), 2, 9, 128),)),
    RegisterResult("decode-1", True),
    RegisterResult("decode-1", False, "page_size: prefill 16 != decode 32"),
    TransferRequest(bootstrap_room=(1 << 63) - 1, dst_pages=(5, 6, 7, 100, 2),
                    dst_metadata_slot=3, decode_prefix_len=32, decode_engine_id="decode-1",
                    prompt_len=100, prompt_digest=W.prompt_digest(range(100))),
    TransferRequest(bootstrap_room=1, dst_pages=(), dst_metadata_slot=0, decode_prefix_len=0,
                    decode_engine_id="d", prompt_len=1, prompt_digest=bytes(16)),
    TransferStatus(bootstrap_room=42, state=KVPoll.Success),
    TransferStatus(bootstrap_room=42, state=KVPoll.Failed, reason="peer down", tp_rank=3),
    TransferStatus(bootstrap_room=42, state=KVPoll.Failed, reason="prompt too long",
                   status_code=400),
    Abort(bootstrap_room=7, sender_id="prefill-0", reason="client disconnected"),
    AbortAck(bootstrap_room=7, sender_id="decode-1"),
    Heartbeat(sender_id="decode-1", role="decode", seq=12345),
]


@pytest.mark.parametrize("msg", ALL_MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    frame = encode_message(msg)
    assert isinstance(frame, bytes)
    back = decode_message(frame)
    assert back == msg
    assert type(back) is type(msg)
    body = msgpack.unpackb(frame)
    assert body["v"] == P.PROTOCOL_VERSION
    assert body["t"] == msg.TYPE.value


def test_page_list_is_packed_and_survives_large_lists():
    pages = np.random.default_rng(0).permutation(np.arange(1, 20001))
    msg = TransferRequest(9, pages, 0, 0, "d", 80000, bytes(16))
    frame = msg.encode()
    assert msgpack.unpackb(frame)["dst_pages"] == pages.astype("<u4").tobytes()
    back = decode_message(frame)
    assert back.dst_pages == tuple(pages.tolist())
    assert len(frame) < 4 * 20000 + 200


def test_status_state_is_an_enum_after_decode():
    back = decode_message(TransferStatus(5, KVPoll.Success).encode())
    assert back.state is KVPoll.Success


def test_kvpoll_order_and_checked_transitions():
    assert [int(s) for s in (KVPoll.Failed, KVPoll.Bootstrapping, KVPoll.WaitingForInput,
                             KVPoll.Transferring, KVPoll.Success)] == [0, 1, 2, 3, 4]
    order = [KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success]
    legal = {(a, b) for a, b in zip(order, order[1:])} | {(a, KVPoll.Failed) for a in order}
    for old in KVPoll:
        for new in KVPoll:
            if (old, new) in legal:
                assert KVPoll.transition(old, new) is new
            else:
                # No skipping, no going back, no staying, nothing after Failed (a late Success
                # must not revive a failed room).
                with pytest.raises(IllegalTransition, match=f"{old.name} -> {new.name}"):
                    KVPoll.transition(old, new)
    assert len(legal) == 7
    assert min(KVPoll.Success, KVPoll.WaitingForInput) == KVPoll.WaitingForInput


def _frame(**body):
    return msgpack.packb(body, use_bin_type=True)


def _good_request_body(**over):
    body = dict(v=P.PROTOCOL_VERSION, t="transfer_request", bootstrap_room=5,
                dst_pages=np.asarray([1, 2], "<u4").tobytes(), dst_metadata_slot=0,
                decode_prefix_len=0, decode_engine_id="d", prompt_len=8,
                prompt_digest=bytes(range(16)))
    body.update(over)
    return body


@pytest.mark.parametrize("frame, field", [
    (b"", "frame"),
    (b"\xc1\xc1\xc1", "frame"),                                       # invalid msgpack
    (msgpack.packb([1, 2, 3]), "frame"),                              # not a map
    (b"\x82\xa1v\x01", "frame"),                                      # truncated map
    (_frame(t="heartbeat", sender_id="a", role="decode", seq=1), "'v'"),
    (_frame(**_good_request_body(v=P.PROTOCOL_VERSION - 1)), "'v'"),
    (_frame(**_good_request_body(v=P.PROTOCOL_VERSION + 1)), "'v'"),
    (_frame(**_good_request_body(v=True)), "'v'"),
    (_frame(**_good_request_body(t="pickle")), "'t'"),
    (_frame(**_good_request_body(t=None)), "'t'"),
    (_frame(**_good_request_body(bootstrap_room=0)), "'bootstrap_room'"),
    (_frame(**_good_request_body(bootstrap_room=1 << 63)), "'bootstrap_room'"),
    (_frame(**_good_request_body(bootstrap_room=-3)), "'bootstrap_room'"),
    (_frame(**_good_request_body(bootstrap_room="5")), "'bootstrap_room'"),
    (_frame(**_good_request_body(bootstrap_room=True)), "'bootstrap_room'"),
    (_frame(**_good_request_body(bootstrap_room=5.0)), "'bootstrap_room'"),
    (_frame(**_good_request_body(dst_pages=b"\x01\x00\x00")), "'dst_pages'"),
    (_frame(**_good_request_body(dst_pages=[1, 2])), "'dst_pages'"),
    (_frame(**_good_request_body(dst_pages=np.asarray([1, 1 << 31], "<u4").tobytes())),
     "'dst_pages"),
    (_frame(**_good_request_body(dst_metadata_slot=-1)), "'dst_metadata_slot'"),
    (_frame(**_good_request_body(decode_prefix_len=-1)), "'decode_prefix_len'"),
    (_frame(**_good_request_body(decode_engine_id="")), "'decode_engine_id'"),
    (_frame(**_good_request_body(decode_engine_id=7)), "'decode_engine_id'"),
    (_frame(**_good_request_body(prompt_len=0)), "'prompt_len'"),
    (_frame(**_good_request_body(prompt_len=True)), "'prompt_len'"),
    (_frame(**_good_request_body(prompt_digest=b"short")), "'prompt_digest'"),
    (_frame(**_good_request_body(prompt_digest="x" * 16)), "'prompt_digest'"),
    (_frame(**{k: v for k, v in _good_request_body().items() if k != "prompt_digest"}),
     "'prompt_digest'"),
    (_frame(**_good_request_body(extra=1)), "unknown field"),
    (_frame(**{k: v for k, v in _good_request_body().items() if k != "dst_metadata_slot"}),
     "'dst_metadata_slot'"),
    (_frame(v=P.PROTOCOL_VERSION, t="transfer_status", bootstrap_room=5, state=2), "'state'"),
    (_frame(v=P.PROTOCOL_VERSION, t="transfer_status", bootstrap_room=5, state=9), "'state'"),
    (_frame(v=P.PROTOCOL_VERSION, t="transfer_status", bootstrap_room=5, state=0,
            status_code=500), "'status_code'"),
    (_frame(v=P.PROTOCOL_VERSION, t="heartbeat", sender_id="a", role="router", seq=0), "'role'"),
    (_frame(v=P.PROTOCOL_VERSION, t="abort", bootstrap_room=5, sender_id="a",
            reason="x" * 5000), "'reason'"),
    (msgpack.packb({1: 2, "v": 1, "t": "heartbeat"}), "map key"),
])
def test_malformed_frames_are_rejected_naming_the_field(frame, field):
    with pytest.raises(ProtocolError) as e:
        decode_message(frame)
    assert field in str(e.value)
    assert isinstance(e.value, ValueError)


def _register_body(**over):
    body = msgpack.unpackb(_register().encode())
    body.update(over)
    return body


@pytest.mark.parametrize("over, field", [
    (dict(tp_rank=1, tp_size=1), "'tp_rank'"),
    (dict(kv_layout="token_major"), "'kv_layout'"),
    (dict(metadata_bytes_per_slot=100), "'metadata_bytes_per_slot'"),
    (dict(metadata_bytes_per_slot=32), "'metadata_bytes_per_slot'"),
    (dict(metadata_addr=0), "'metadata_addr'"),
    (dict(metadata_num_slots=0), "'metadata_num_slots'"),
    (dict(page_size=0), "'page_size'"),
    (dict(reply_endpoint="ipc:///tmp/x"), "'reply_endpoint'"),
    (dict(reply_endpoint="tcp://127.0.0.1:99999"), "'reply_endpoint'"),
    (dict(kv_buffers=[]), "'kv_buffers'"),
    (dict(kv_buffers="x"), "'kv_buffers'"),
    (dict(kv_buffers=[{"shard_addrs": [-1], "num_layers": 1, "num_pages": 4,
                       "bytes_per_page": 8}]), "shard_addrs[0]"),
    (dict(kv_buffers=[{"shard_addrs": [], "num_layers": 1, "num_pages": 4,
                       "bytes_per_page": 8}]), "'shard_addrs'"),
    (dict(kv_buffers=[{"shard_addrs": [4096], "num_layers": 0, "num_pages": 4,
                       "bytes_per_page": 8}]), "'num_layers'"),
    (dict(kv_buffers=[{"shard_addrs": [4096], "num_layers": 1, "num_pages": 1,
                       "bytes_per_page": 8}]), "'num_pages'"),
    (dict(kv_buffers=[{"shard_addrs": [4096], "num_layers": 1, "num_pages": 4}]),
     "'bytes_per_page'"),
    (dict(kv_buffers=[{"shard_addrs": [4096], "num_layers": 1, "num_pages": 4,
                       "bytes_per_page": 8, "evil": 1}]), "unknown field"),
    (dict(kv_buffers=[[4096, 1, 4, 8]]), "kv_buffers[0]"),
])
def test_bad_registration_is_rejected(over, field):
    with pytest.raises(ProtocolError) as e:
        decode_message(msgpack.packb(_register_body(**over), use_bin_type=True))
    assert field in str(e.value)


def test_constructing_an_invalid_message_raises_too():
    with pytest.raises(ProtocolError, match="'bootstrap_room'"):
        TransferRequest(0, (1,), 0, 0, "d", 4, bytes(16))
    with pytest.raises(ProtocolError, match="dst_pages"):
        TransferRequest(5, [1, True], 0, 0, "d", 4, bytes(16))
    with pytest.raises(ProtocolError, match="'state'"):
        TransferStatus(5, KVPoll.Transferring)
    with pytest.raises(TypeError):
        encode_message({"v": 1})


def test_oversized_frame_is_rejected_before_parsing():
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_message(b"\x00" * (W.MAX_FRAME_BYTES + 1))


def test_validate_pages_ranges_and_duplicates():
    assert validate_pages([1, 5, 9], 10).tolist() == [1, 5, 9]
    assert validate_pages(np.array([], np.int32), 10).tolist() == []
    with pytest.raises(ProtocolError, match=r"'dst_pages': page index 0 outside \[1, 10\)"):
        validate_pages([3, 0], 10, "dst_pages")
    with pytest.raises(ProtocolError, match=r"page index 10 outside \[1, 10\)"):
        validate_pages([10], 10)
    with pytest.raises(ProtocolError, match="page index -2"):
        validate_pages([-2, 4], 10)
    with pytest.raises(ProtocolError, match=r"duplicate page indices \[4\]"):
        validate_pages([4, 5, 4], 10)
    with pytest.raises(ProtocolError, match="integers"):
        validate_pages([1.5], 10)
    with pytest.raises(ProtocolError, match="1-D"):
        validate_pages([[1, 2]], 10)
    for bad in ([3, True], [False], [None], ["3"]):
        with pytest.raises(ProtocolError, match="'pages': page indices must be integers"):
            validate_pages(bad, 10)


def test_find_duplicates():
    assert find_duplicates([]) == []
    assert find_duplicates([3, 1, 2]) == []
    assert find_duplicates([5, 3, 5, 3, 5, 9]) == [3, 5]
    assert find_duplicates(np.array([7, 7])) == [7]


def test_prompt_digest_depends_on_every_token_and_its_position():
    ids = list(range(40))
    d = prompt_digest(ids)
    assert len(d) == 16 and prompt_digest(np.asarray(ids)) == d
    assert prompt_digest(ids[:-1] + [41]) != d
    assert prompt_digest(ids[1:] + ids[:1]) != d
    assert prompt_digest(ids + [0]) != d
