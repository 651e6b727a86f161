"""benchmarks/suite.toml and docs/benchmarks.md stay in step: every suite entry is a command that parses and
reproduces a section the docs have, every entry is named in the docs, every result file a doc cites is
committed under bench/results/ and no uncited one is; run_suite.py runs entries and records them."""
from __future__ import annotations

import importlib
import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import run_suite  # noqa: E402  (benchmarks/ is not a package that is installed)

BENCHMARKS_MD = (ROOT / "docs" / "benchmarks.md").read_text()
RESULTS = ROOT / "bench" / "results"
CITED = re.compile(r"(?:\.\.\.-|20\d\d-\d\d-\d\d-)[\w.{},+-]*?\.(?:json|log|png)\b")
SUITE = run_suite.load_suite()


def _filled(argv: list[str]) -> list[str]:
    return [a.replace("{out}", "/x/out.json").replace("{dir}", "/x").replace("{disk}", "/x/disk") for a in argv]


def _expanded(token: str) -> list[str]:
    """``a-{b,c}-d`` -> [a-b-d, a-c-d]."""
    parts = re.split(r"(\{[^}]*\})", token)
    choices = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*choices)]


def _cited_results(text: str) -> list[str]:
    """bench/results names a text cites; ``{a,b}`` expanded, a ``...-`` prefix standing for the rest."""
    return [name for token in CITED.findall(text) for name in _expanded(token)]


def _backticked_names(text: str) -> set[str]:
    """Names in backticks, ``{a,b}`` expanded (`serve-4b-{gpu,host}-c64` names two entries)."""
    return {name for token in re.findall(r"`([a-z0-9{},-]+)`", text) for name in _expanded(token)}


def _resolve(name: str, files: list[str]) -> list[str]:
    return [f for f in files if f.endswith(name[3:])] if name.startswith("...-") else [f for f in files if f == name]


NAMED = _backticked_names(BENCHMARKS_MD)


def test_every_entry_reproduces_a_section_and_is_named_in_the_docs():
    sections = set(re.findall(r"^## (.+)$", BENCHMARKS_MD, re.M))
    for name, e in SUITE.items():
        doc, _, heading = e["section"].rpartition(": ")  # "store.md: HEADING": a heading of another doc
        headings = (set(re.findall(r"^#{2,3} (.+)$", (ROOT / "docs" / doc).read_text(), re.M)) if doc
                    else sections)
        assert any(s.startswith(heading) for s in headings), (name, e["section"], headings)
        assert name in NAMED or re.search(rf"# {re.escape(name)}\b", BENCHMARKS_MD), \
            f"suite entry {name!r} is not named in docs/benchmarks.md"


def test_every_entry_named_in_the_docs_exists():
    """Names the docs give as "suite `NAME`" or as the comment after a console command."""
    consoles = "".join(re.findall(r"```console\n(.*?)```", BENCHMARKS_MD, re.S))
    named = re.findall(r"suite `([a-z0-9-]+)`", BENCHMARKS_MD) + re.findall(r"#\s+([a-z0-9-]+)", consoles)
    assert len(named) >= 10, named
    missing = sorted(set(named) - set(SUITE))
    assert not missing, f"docs/benchmarks.md names suite entries that suite.toml lacks: {missing}"


def test_every_entry_command_parses():
    from engram.cli import build_parser

    parser = build_parser()
    for name, e in SUITE.items():
        argv = _filled(e["argv"])
        if argv[0] == "engram":
            parser.parse_args(argv[1:])  # SystemExit on an unknown subcommand or option
        elif argv[:2] == ["python", "-m"]:
            module = argv[2]
            assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), (name, module)
            mod = importlib.import_module(module)
            if hasattr(mod, "add_arguments"):
                import argparse

                p = argparse.ArgumentParser()
                mod.add_arguments(p)
                p.parse_args(argv[3:])
        else:
            assert argv[0] == "make", (name, argv)


def test_cited_results_exist_and_uncited_ones_are_not_kept():
    files = sorted(p.name for p in RESULTS.iterdir())
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    cited, unresolved = set(), []
    for doc in docs:
        for name in _cited_results(doc.read_text()):
            found = _resolve(name, files)
            if len(found) != 1:
                unresolved.append(f"{doc.name}: {name} ({len(found)} files)")
            cited.update(found)
    assert not unresolved, "cited results that are not one file in bench/results:\n" + "\n".join(unresolved)
    uncited = sorted(set(files) - cited)
    assert not uncited, "bench/results files no doc cites (git rm them; history keeps them):\n" + "\n".join(uncited)


def test_benchmarks_folder_is_not_installed():
    pyproject = (ROOT / "pyproject.toml").read_text()
    include = re.search(r"\[tool\.setuptools\.packages\.find\]\s*include\s*=\s*\[([^\]]*)\]", pyproject)
    assert include and re.findall(r'"([^"]+)"', include.group(1)) == ["engram*"], pyproject


def test_run_suite_runs_entries_and_records_them(tmp_path):
    suite = tmp_path / "suite.toml"
    suite.write_text('''
[[entry]]
name = "ok"
section = "Engine"
needs = "cpu"
what = "writes its result"
argv = ["python", "-c", "import json, sys; json.dump({'x': 1}, open(sys.argv[1], 'w')); print('{\\"tier\\": 1}')", "{out}"]

[[entry]]
name = "fails"
section = "Engine"
needs = "cpu"
what = "exits 3"
argv = ["python", "-c", "raise SystemExit(3)"]
''')
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_suite.py"), "ok", "fails", "--out", str(out),
                        "--suite", str(suite)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "failed: fails" in r.stderr, (r.stdout, r.stderr)
    assert json.loads((out / "ok.json").read_text()) == {"x": 1}
    assert '{"tier": 1}' in (out / "ok.log").read_text()
    runs = json.loads((out / "suite.json").read_text())["runs"]
    assert [(x["name"], x["rc"]) for x in runs] == [("ok", 0), ("fails", 3)]


def test_run_suite_refuses_unknown_names_and_a_missing_disk(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("ENGRAM_CACHE_DIR", raising=False)
    with pytest.raises(SystemExit) as e:
        run_suite.main(["no-such-entry", "--out", str(tmp_path)])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        run_suite.main(["disk", "--out", str(tmp_path), "--dry-run"])
    assert e.value.code == 2 and "--disk" in capsys.readouterr().err
    assert run_suite.main(["disk", "--out", str(tmp_path), "--dry-run", "--disk", "/d"]) == 0
    assert "--cache-dir /d" in capsys.readouterr().out
