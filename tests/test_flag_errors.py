"""Every command's flag errors, argparse's own included, are one line ``error: FIELD: ...`` and
exit 2 without the usage block (``config_fields.FlagParser``; serve's and aot's are in their own
tests)."""

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
