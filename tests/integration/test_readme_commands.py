"""Every command of README.md in a ```sh block runs as written, for real, on the CPU: each block is one bash
script (set -euo pipefail) run from the repository root in a fresh shell (no venv on PATH), so a command
with a default that does not fit the tiny model, a typo or a missing file fails here. Blocks fenced
```console (commands that need a GPU or a real checkpoint) are documentation and are not run. `make run` and
`make test` themselves are skipped (they start a server / this suite), and so are curl commands (they run against a
real `engram serve` in tests/integration/test_server_readme.py, their answers checked); paths under /tmp/ are moved
into this test's temporary directory; tables are built in the session's cache."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest


pytestmark = pytest.mark.timeout(1200)

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SKIPPED = ("make run", "make test", "curl ")


def sh_blocks(text: str) -> list[str]:
    """The bodies of the ```sh blocks, in order."""
    return re.findall(r"^```sh\n(.*?)^```", text, re.S | re.M)


def _lines(block: str) -> list[str]:
    """The block's commands: backslash continuations joined, blank and comment-only lines dropped."""
    lines = block.replace("\\\n", " ").splitlines()
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


def _runnable(block: str) -> str:
    return "\n".join(line for line in _lines(block) if not line.strip().startswith(SKIPPED))


@pytest.fixture(scope="module")
def fresh_shell_env(tmp_path_factory) -> dict[str, str]:
    """A new shell in a clone: no venv on PATH, no VIRTUAL_ENV, no variables of an enclosing `make test`."""
    if not (ROOT / ".venv").is_dir():
        pytest.skip("the README's commands assume `make run` made .venv in the repository")
    inherited = {"VIRTUAL_ENV", "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "PYTHONPATH"}
    env = {k: v for k, v in os.environ.items() if k not in inherited}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and not Path(p, "engram").exists())
    env["ENGRAM_CACHE_DIR"] = str(tmp_path_factory.getbasetemp() / "engram-cache")
    return env


def test_the_readme_marks_its_commands():
    blocks = sh_blocks(README.read_text())
    assert blocks, "README.md has no ```sh block: its runnable commands are fenced ```sh (GPU-only ones ```console)"
    assert any(_runnable(b) for b in blocks)


def test_every_sh_command_of_the_readme_runs_as_written(fresh_shell_env, tmp_path_factory):
    blocks = [b for b in sh_blocks(README.read_text()) if _runnable(b)]
    scratch = tmp_path_factory.mktemp("readme")
    for i, block in enumerate(blocks):
        script = _runnable(block).replace("/tmp/", f"{scratch}/")
        r = subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], cwd=ROOT, env=fresh_shell_env,
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, (f"README ```sh block {i} failed (exit {r.returncode}):\n{script}",
                                   r.stdout[-3000:], r.stderr[-3000:])
