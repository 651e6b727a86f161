"""The README runs as written, from the repository root of a clone after `make run`, in a shell whose PATH
does not have the venv on it: the API tour, every command in its inline code spans and the ``make`` lines of its
```sh blocks (cheap ones for real, the others with ``--help``, which still checks the program exists and parses
every option given before it), and every command the command table names. The other lines of the ```sh blocks run
for real in tests/integration/test_readme_commands.py; ```console blocks (a GPU, a checkpoint, long runs) are not
run. Commands that need a running server (curl, the openai snippet) run in tests/integration/test_server_readme.py;
a README command no test knows how to run fails here."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from engram.cli import main

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
ENGRAM = ".venv/bin/engram"
# `.venv/bin/engram SUBCOMMAND FIRST_ARG` lines cheap enough to run for real in a test; the rest get --help.
RUN_FOR_REAL = {("generate", "tiny"), ("convert", "--random"), ("inspect", "--verify"), ("inspect", "--preset")}
NEEDS_SERVER = {"curl"}  # run against a real server by tests/integration/test_server_readme.py


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def shell_commands(text: str) -> list[list[str]]:
    """argv of every README command: each line of a ```sh block (backslash continuations joined, comments
    dropped) and each inline code span that starts with ``make `` or ``.venv/bin/``."""
    commands = []
    for block in code_blocks(text, "sh"):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                commands.append(argv)
    for span in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", text):
        if span.startswith(("make ", ".venv/bin/")):
            commands.append(shlex.split(span))
    return commands


def table_commands(text: str) -> list[list[str]]:
    """The subcommand words of every `engram ...` in the first column of the command table."""
    section = text.split("## Command line", 1)[1].split("\n## ", 1)[0]
    found = []
    for row in re.findall(r"^\| (.*?) \|", section, re.M):
        for span in re.findall(r"`(engram [^`]+)`", row):
            words = []
            for w in span.split()[1:]:
                if w.startswith(("[", "-")) or w.isupper() or w == "...":
                    break
                words.append(w)
            found.append(words)
    return found


@pytest.fixture(scope="module")
def fresh_shell_env() -> dict[str, str]:
    """The environment of a new shell in a clone: no venv on PATH, no VIRTUAL_ENV, and none of the variables
    an enclosing `make test` exports (a nested make would print its directory changes)."""
    if not (ROOT / ".venv").is_dir():
        pytest.skip("the README's commands assume `make run` made .venv in the repository")
    inherited = {"VIRTUAL_ENV", "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES"}
    env = {k: v for k, v in os.environ.items() if k not in inherited}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and not Path(p, "engram").exists())
    return env


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_readme_api_tour_runs():
    tour = README.split("## API tour", 1)[1]
    code = code_blocks(tour, "python")[0]
    exec(compile(code, "README.md:api-tour", "exec"), {})


def test_readme_fences_follow_the_convention():
    """```sh runs on a CPU machine as written, ```console needs a GPU or a long run, ```python is executed."""
    fences = re.findall(r"^```(.*)$", README, re.M)[0::2]  # opening fences; the closing ones alternate
    assert fences and set(fences) <= {"sh", "console", "python"}, fences


def test_readme_keeps_the_two_command_setup():
    first = shell_commands(README)[:2]
    assert first == [["make", "run"], ["make", "test"]], first


def inline_commands(text: str) -> list[list[str]]:
    """``shell_commands`` but a ```sh block's lines other than ``make``: tests/integration/test_readme_commands.py runs
    those blocks for real, as bash scripts."""
    in_blocks = [shlex.split(line, comments=True) for block in code_blocks(text, "sh")
                 for line in block.replace("\\\n", " ").splitlines()]
    return [argv for argv in shell_commands(text) if argv[0] == "make" or argv not in in_blocks]


def test_every_readme_shell_command_runs_as_written(fresh_shell_env, tmp_path):
    commands = inline_commands(README)
    assert len(commands) >= 6 and len(commands) < len(shell_commands(README)), commands
    for argv in commands:
        argv = [a.replace("/tmp/t", str(tmp_path / "t")) for a in argv]  # the examples' scratch directory
        shown = shlex.join(argv)
        if argv[0] in NEEDS_SERVER:
            continue
        if argv[0] == "make":
            dry = _run(["make", "-n", *argv[1:]], fresh_shell_env)
            assert dry.returncode == 0, (shown, dry.stderr)
            if argv[1] != "run":  # test, device-test: the target exists and its recipe expands
                assert "pytest" in dry.stdout, (shown, dry.stdout)
                continue
            argv = shlex.split(dry.stdout.splitlines()[-1])  # what make would start, with ARGS
            assert argv[0] == ENGRAM, (shown, argv)
        assert argv[0].startswith(".venv/bin/"), f"README command `{shown}` does not run from a fresh shell " \
                                                 f"(write {ENGRAM} ..., or no test knows how to run it)"
        real = argv[0] == ENGRAM and tuple(argv[1:3]) in RUN_FOR_REAL
        r = _run(argv if real else [*argv, "--help"], fresh_shell_env)
        assert r.returncode == 0, (shown, r.stdout[-2000:], r.stderr[-2000:])
        if not real:
            assert "usage:" in r.stdout.lower(), (shown, r.stdout[:300])
        elif argv[1] == "generate":
            assert "tok/s" in r.stdout, (shown, r.stdout[-500:])
        elif argv[1:3] == ["inspect", "--verify"]:
            assert "crc" in r.stdout.lower(), (shown, r.stdout[-500:])
        elif argv[1] == "inspect":
            assert "GiB" in r.stdout, (shown, r.stdout[-500:])


def test_a_bare_engram_command_would_fail_that_test(fresh_shell_env):
    """The check above is real: a fresh shell has no `engram` on its PATH."""
    with pytest.raises(FileNotFoundError):
        _run(["engram", "--help"], fresh_shell_env)


def test_every_command_in_the_table_exists(capsys):
    commands = table_commands(README)
    assert ["serve"] in commands and ["bench", "ab"] in commands, commands
    for words in commands:
        with pytest.raises(SystemExit) as e:
            main([*words, "--help"])
        assert e.value.code == 0, words
        assert capsys.readouterr().out.startswith(f"usage: engram {' '.join(words)}"), words
