import pytest

from engram.cli import COMMANDS, main


def test_every_command_is_installed(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)


@pytest.mark.parametrize("config,needle", [('{"cache_row": 3}', "unknown key(s) ['cache_row']"),
                                           ("{not json", "not valid JSON"),
                                           ('{"cpu_offload": "yes"}', "cpu_offload='yes'")])
def test_serve_refuses_bad_engram_config_before_starting(capsys, config, needle):
    assert main(["serve", "--engram-config", config]) == 2
    assert needle in capsys.readouterr().err
