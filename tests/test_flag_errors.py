"""Every command's flag errors, argparse's own included, are one line ``error: FIELD: ...`` and
exit 2 without the usage block (``config_fields.FlagParser``; serve's and aot's are in their own
tests)."""

import re

import pytest


@pytest.mark.parametrize("argv,line", [
    (["--decode", "http://d", "--prefill", "http://p", "--port", "x"],
     "error: port: invalid int value: 'x'\n"),
    (["--decode", "http://d"], "error: the following arguments are required: --prefill\n"),
    (["--decode", "http://d", "--prefill", "http://p", "--policy", "random"],
     "error: policy: invalid choice: 'random' (choose from 'load_aware', 'round_robin')\n"),
])
def test_router_flag_errors_are_one_line(capsys, argv, line):
    from pdjax.router.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and capsys.readouterr().err == line


def test_convert_errors_are_one_line(capsys, tmp_path):
    from pdjax.convert import main

    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    assert capsys.readouterr().err == "error: the following arguments are required: dst\n"
    with pytest.raises(SystemExit):
        main(["--default"])       # dst is then missing too
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([str(tmp_path / "a"), str(tmp_path / "b"), "--default"])
    assert capsys.readouterr().err == "error: give SRC or --default (exactly one)\n"
    assert main([str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / 'nowhere'}: model path not found (a "
                                       "local folder, a .gguf file or a Hugging Face model id "
                                       "org/name)\n")


def test_router_reports_an_unknown_flag_before_missing_ones(capsys):
    """``python -m pdjax.router --bogus`` said only that --prefill and --decode are required
    (argparse checks the required flags before the unknown ones)."""
    from pdjax.router.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--bogus"])
    assert e.value.code == 2
    assert capsys.readouterr().err == "error: unrecognized arguments: --bogus\n"


# One bad setting per check (the generic type / range / choice checks and each group's own),
# every one refused before the checkpoint is read.
_BAD_SERVE_FLAGS = [
    (["--tp-size", "0"], "tp_size: must be a positive integer, got 0"),
    (["--enable-dp-attention", "--dp-size", "2"], "dp_size: 2 must divide tp_size (1)"),
    (["--dp-size", "2", "--tp-size", "2"], "dp_size: 2 ranks need enable_dp_attention"),
    (["--tp-size", "4", "--ep-size", "3"], "ep_size: 3 must divide tp_size (4)"),
    (["--context-length", "1"], "context_length: must be >= 2, got 1"),
    (["--page-size", "x"], "page_size: invalid int value: 'x'"),
    (["--page-size", "-1"], "page_size: must be a positive integer, got -1"),
    (["--max-total-tokens", "10"], "max_total_tokens: 10 must hold at least two pages"),
    (["--mem-fraction-static", "1.5"], "mem_fraction_static: must be in (0, 1], got 1.5"),
    (["--hicache-ratio", "0"], "hicache_ratio: must be > 0, got 0.0"),
    (["--hicache-storage-backend-extra-config", "{}"],
     "hicache_storage_backend_extra_config: set without hicache_storage_backend"),
    (["--enable-hierarchical-cache", "--disable-radix-cache"],
     "enable_hierarchical_cache: the host tier backs the prefix cache"),
    (["--kv-cache-dtype", "int3"], "kv_cache_dtype: invalid choice: 'int3'"),
    (["--target-itl-ms", "5"], "target_itl_ms: it sizes the prefill part of mixed steps"),
    (["--max-num-batched-tokens", "0"], "max_num_batched_tokens: must be a positive integer"),
    (["--num-reserved-decode-tokens", "-1"], "num_reserved_decode_tokens: must be >= 0"),
    (["--disaggregation-bootstrap-port", "-1"],
     "disaggregation_bootstrap_port: must be a non-negative integer, got -1"),
    (["--port", "70000"], "port: must be in [0, 65535], got 70000"),
    (["--role", "decode", "--disaggregation-mode", "prefill"],
     "disaggregation_mode: 'prefill' (role 'prefill') contradicts role 'decode'"),
    (["--nnodes", "2"], "dist_init_addr: must be HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"],
     "node_rank: must be in [0, nnodes=2), got 2"),
    (["--nnodes", "2", "--dist-init-addr", "h:1", "--role", "prefill",
      "--disaggregation-bootstrap-port", "0"], "disaggregation_bootstrap_port: must be set"),
    (["--nnodes", "2", "--dist-init-addr", "h:1", "--speculative-algorithm", "mtp"],
     "speculative_algorithm: 'mtp' with nnodes > 1 is not supported"),
    (["--speculative-algorithm", "ngram", "--speculative-draft-model-path", "d"],
     "speculative_draft_model_path: must be set with (and only with)"),
    (["--speculative-num-draft-tokens", "1"],
     "speculative_num_draft_tokens: must be an integer >= 2, got 1"),
    (["--speculative-ngram-min-match-window-size", "5",
      "--speculative-ngram-max-match-window-size", "3"],
     "speculative_ngram_max_match_window_size: must be >= "),
]


@pytest.mark.parametrize("argv,start", _BAD_SERVE_FLAGS, ids=[" ".join(a) for a, _ in
                                                                 _BAD_SERVE_FLAGS])
def test_serve_setting_errors_name_the_field_first(capsys, argv, start):
    """Every parse-time error of ``python -m pdjax.serve`` is one line ``error: FIELD: ...``
    (many read ``error: tp_size must be ...`` or ``error: dp_size (2) must divide ...``)."""
    from pdjax.serve import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.endswith("\n"), err
    assert re.match(r"^error: [a-z_]+: ", err), err
    assert err.startswith(f"error: {start}"), err
