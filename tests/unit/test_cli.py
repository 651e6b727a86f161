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


def test_bench_offers_the_benches_users_run_and_imports_nothing_above_it(capsys):
    """The bench subcommands are the ones users run (probes live in benchmarks/, outside the package), and
    engram.bench sits below the command layer: none of its modules imports engram.commands or engram.cli."""
    import ast
    from pathlib import Path

    import engram.bench
    from engram.commands.bench import BENCHES

    assert sorted(BENCHES) == ["ab", "corpus", "engine", "hit-rate", "lookup", "paper", "placement", "serve"]
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in BENCHES)
    upward = []
    for path in sorted(Path(engram.bench.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            upward += [f"{path.name}: {n}" for n in names if n.startswith(("engram.commands", "engram.cli"))]
    assert not upward, upward
