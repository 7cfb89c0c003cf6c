"""Fixtures of the benchmark tests: the scripts' small mode on the tiny Llama checkpoint.

Every engine here (servers and in-process) uses the same shapes (``TINY_FLAGS``), so the
persistent compilation cache serves all of them after the first.
"""

import pytest

from bench_settings import TINY_FLAGS  # also puts scripts/ on sys.path


@pytest.fixture(scope="package")
def server_profile_dir(tmp_path_factory):
    """The servers' ``--profile-dir`` (where ``/start_profile`` writes without ``output_dir``)."""
    return tmp_path_factory.mktemp("server_profiles")


@pytest.fixture(scope="package")
def deployment(tiny_checkpoints, server_profile_dir):
    """Prefill + decode (Mooncake) + router + colocated servers on 127.0.0.1, ephemeral ports,
    started by bench_transfer's own launcher: ``{prefill, decode, router, colocated}`` URLs."""
    import bench_transfer

    args = bench_transfer.parse_args(["--model-path", tiny_checkpoints["llama"], *TINY_FLAGS,
                                      "--input-lens", "100"])
    with bench_transfer.deployment(args, ("--profile-dir", str(server_profile_dir))) as urls:
        yield urls
