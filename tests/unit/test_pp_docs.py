"""Every `$ engram ...` example of docs/pp.md runs as written (in-process, from the repository root) and
prints exactly the output the page shows; `; echo "exit $?"` examples also check the exit status."""
import re
import shlex
from pathlib import Path

import pytest

from engram.cli import main
from engram.parallel.pp import PARTITION_ENV

REPO = Path(__file__).resolve().parents[2]
ECHO_EXIT = '; echo "exit $?"'


def examples(markdown: str) -> list[tuple[str, str]]:
    """(command line, expected output) of every line starting with ``$ `` inside a fenced block; the output
    is every following line of the block up to the next ``$ `` line, less the blank lines that separate
    one example from the next."""
    found, block, current = [], False, None
    for line in markdown.splitlines():
        if line.startswith("```"):
            block = not block
        if line.startswith("```") or (block and line.startswith("$ ")):
            if current is not None:
                found.append((current[0], current[1].rstrip("\n") + "\n" if current[1].strip() else ""))
            current = (line[2:], "") if block and line.startswith("$ ") else None
        elif block and current is not None:
            current = (current[0], current[1] + line + "\n")
    return found


EXAMPLES = examples((REPO / "docs" / "pp.md").read_text(encoding="utf-8"))


def test_the_page_has_examples():
    assert len(EXAMPLES) >= 2 and all(cmd.startswith("engram ") for cmd, _ in EXAMPLES)


@pytest.mark.parametrize("command, expected", EXAMPLES, ids=[c for c, _ in EXAMPLES])
def test_example_runs_as_written(command, expected, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.delenv(PARTITION_ENV, raising=False)
    want_exit = 0
    if command.endswith(ECHO_EXIT):
        command = command[: -len(ECHO_EXIT)]
        *lines, last = expected.splitlines()
        want_exit = int(re.fullmatch(r"exit (\d+)", last).group(1))
        expected = "".join(l + "\n" for l in lines)
    argv = shlex.split(command)
    assert argv[0] == "engram"
    code = main(argv[1:])
    out = capsys.readouterr()
    assert code == want_exit
    assert out.out + out.err == expected
