"""The README's commands that talk to a running server (curl, the openai client snippet) run as written
against a real `engram serve` subprocess; only the port differs from the README's 8000."""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from engram.server.launcher import ServerProcess
from tests.unit.test_readme import NEEDS_SERVER, README, ROOT, code_blocks, shell_commands

pytestmark = pytest.mark.timeout(600)
README_PORT = "127.0.0.1:8000"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(["tiny", "--threads", "1"], tmp_path_factory.getbasetemp() / "engram-cache",
                      tmp_path_factory.mktemp("srv") / "server.log") as s:
        yield s


def test_readme_serves_on_the_port_its_snippets_use():
    assert ":8000" in README.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    from engram.cli import build_parser

    assert build_parser().parse_args(["serve"]).port == 8000


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_readme_curl_commands(server):
    commands = [argv for argv in shell_commands(README) if argv[0] in NEEDS_SERVER]
    assert commands
    for argv in commands:
        argv = [a.replace(README_PORT, server.url.removeprefix("http://")) for a in argv]
        r = subprocess.run(argv + ["--silent", "--show-error", "--fail"], capture_output=True, text=True,
                           timeout=120, cwd=ROOT)
        assert r.returncode == 0, (argv, r.stderr)
        body = json.loads(r.stdout)
        assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] >= 1, body


def test_readme_openai_snippet(server, capsys):
    snippets = [c for c in code_blocks(README, "python") if "OpenAI(" in c]
    assert len(snippets) == 1
    code = snippets[0].replace(README_PORT, server.url.removeprefix("http://"))
    assert re.search(r"base_url=\"http://127\.0\.0\.1:\d+/v1\"", code)
    exec(compile(code, "README.md:openai", "exec"), {})
    assert capsys.readouterr().out.count("\n") >= 2  # the completion's text, then the streamed chat text
