"""Test double shared by the multi-host PD unit tests (test_ranks.py, test_decode_ranks.py)."""

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
