import pytest

from pdjax.transfer.engine import create_transfer_engine


@pytest.fixture(scope="module")
def mooncake_pair():
    """Two Mooncake transfer engines in this process, on 127.0.0.1."""
    a = create_transfer_engine("mooncake", "127.0.0.1")
    b = create_transfer_engine("mooncake", "127.0.0.1")
    yield a, b
    a.close()
    b.close()
