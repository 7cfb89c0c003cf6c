"""Sealed control frames (``pdjax.pd.frame_auth``): a tampered, replayed, stale or
wrongly keyed frame is refused with its reason; fresh frames pass."""

import pytest

from pdjax.pd.frame_auth import AuthError, FrameAuthenticator, FrameSealer
from pdjax.pd.protocol import Heartbeat


def test_frame_authenticator_rejects_tamper_replay_stale_and_wrong_secret():
    now = [1000.0]
    seal = FrameSealer("s3cret", clock=lambda: now[0])
    auth = FrameAuthenticator("s3cret", window_s=30, clock=lambda: now[0])
    body = Heartbeat("x", "decode", 1).encode()
    f1, f2 = seal.seal(body), seal.seal(body)
    assert auth.open(f1) == body and auth.open(f2) == body
    for frame, reason in ((f1, "replay"), (f2, "replay"),
                          (f1[:-1] + bytes([f1[-1] ^ 1]), "hmac"),
                          (f1[:20] + bytes([f1[20] ^ 1]) + f1[21:], "hmac"),
                          (FrameSealer("other").seal(body), "hmac"), (body, "hmac"), (b"", "hmac")):
        with pytest.raises(AuthError) as e:
            auth.open(frame)
        assert e.value.reason == reason, (frame, e.value)
    old = seal.seal(body)
    now[0] += 31
    with pytest.raises(AuthError) as e:
        auth.open(old)
    assert e.value.reason == "stale"
    assert auth.open(seal.seal(body)) == body          # fresh frames still pass
    with pytest.raises(ValueError, match="disaggregation_secret"):
        FrameSealer("")
