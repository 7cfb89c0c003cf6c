"""Test doubles shared by the multi-host PD unit tests (test_ranks.py, test_decode_ranks.py)."""

import types


class FakeCluster:
    """Node 0's ``Cluster`` of two nodes, no node lost: ``send`` records each mirrored op
    and its fields in ``sent``."""

    args = types.SimpleNamespace(nnodes=2)
    lost = None

    def __init__(self):
        self.sent = []

    def send(self, op, **fields):
        self.sent.append((op, fields))


class RecordingEngine:
    """A transfer engine that writes nothing: ``batch_write`` records ``(session, copies)``
    in ``writes``."""

    def __init__(self):
        self.writes = []

    def batch_write(self, session, copies):
        self.writes.append((session, list(copies)))
