"""The host tier's flags (SGLang's names): one ``error: FIELD: ...`` line at parse time for what
is not built or cannot work, nothing loaded (DESIGN.md §3, "Host tier")."""

import pytest

from pdjax.config import ServerArgs


@pytest.mark.parametrize("argv,line", [
    (["--hicache-write-policy", "write_later"],
     "error: hicache_write_policy: invalid choice: 'write_later' (choose from "
     "'write_through', 'write_back', 'write_through_selective')\n"),
    (["--enable-hierarchical-cache", "--disable-radix-cache"],
     "error: enable_hierarchical_cache: the host tier backs the prefix cache, which "
     "disable_radix_cache turns off\n"),
    (["--enable-hierarchical-cache", "--role", "decode"],
     "error: enable_hierarchical_cache: only on a colocated or prefill single-host server "
     "without another KV connector, got role 'decode'\n"),
    (["--hicache-ratio", "0"], "error: hicache_ratio: must be > 0, got 0.0\n"),
    (["--hicache-size", "-1"],
     "error: hicache_size: must be >= 0 GiB (0: use hicache_ratio), got -1\n"),
    (["--hicache-size", "1.5"], "error: hicache_size: invalid int value: '1.5'\n"),
])
def test_hicache_flag_errors_are_one_line(capsys, argv, line):
    from pdjax.serve import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--port", "0", *argv])
    assert e.value.code == 2 and capsys.readouterr().err == line


def test_hicache_flags_parse_and_default():
    from pdjax.serve import parse_args

    args = parse_args(["--port", "0", "--enable-hierarchical-cache", "--hicache-ratio", "3.5",
                       "--hicache-size", "2", "--hicache-write-policy", "write_through"])
    assert (args.enable_hierarchical_cache, args.hicache_ratio, args.hicache_size,
            args.hicache_write_policy) == (True, 3.5, 2, "write_through")
    for policy in ("write_back", "write_through_selective"):
        args = parse_args(["--port", "0", "--enable-hierarchical-cache",
                           "--hicache-write-policy", policy])
        assert args.hicache_write_policy == policy
    off = ServerArgs()
    assert (off.enable_hierarchical_cache, off.hicache_ratio, off.hicache_size,
            off.hicache_write_policy) == (False, 2.0, 0, "write_through")
    with pytest.raises(ValueError, match=r"^enable_hierarchical_cache: .* got kv_connector 'x'"):
        ServerArgs(enable_hierarchical_cache=True, kv_connector="x")
    with pytest.raises(ValueError, match=r"^enable_hierarchical_cache: .* got nnodes 2"):
        ServerArgs(enable_hierarchical_cache=True, nnodes=2, dist_init_addr="h:1234")


def test_the_file_stores_folder_is_checked_at_parse_time(capsys, tmp_path, tiny_checkpoints):
    """A folder that cannot be made is one error line before the model loads (it failed after
    loading, exit 1); a missing one is made."""
    from pdjax.serve import parse_args

    base = ["--port", "0", "--model-path", tiny_checkpoints["llama"],
            "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
            "--hicache-storage-backend-extra-config"]
    with pytest.raises(SystemExit) as e:
        parse_args(base + ['{"path": "/proc/nope"}'])
    assert e.value.code == 2 and capsys.readouterr().err == (
        "error: hicache_storage_backend_extra_config: cannot write in /proc/nope (No such file "
        "or directory)\n")
    folder = tmp_path / "a" / "store"
    parse_args(base + [f'{{"path": "{folder}"}}'])
    assert folder.is_dir()
