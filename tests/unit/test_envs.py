"""engram/envs.py is the one place the package reads its environment: at most six variables, each documented;
the switches of decided experiments (and the server's thread engine loop) stay deleted; code comments carry no commit
hashes or timings."""
from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

from engram import envs

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = sorted((ROOT / "engram").rglob("*.py"))
# variables and module attributes of decided experiments, deleted with their losing branches (docs/log.md)
DELETED = ("ENGRAM_FIRST_LOOKUP_ALONE", "ENGRAM_TOGETHER_WHEN_DEEP", "ENGRAM_LATER_AT_FIRST_READ",
           "ENGRAM_LATE_CACHING", "ENGRAM_DISK_DECODE_IN_GRAPH", "ENGRAM_CACHE_PROBE", "ENGRAM_BACKGROUND_LOOKUPS",
           "ENGRAM_EARLY_HOST_IDS", "ENGRAM_PIECEWISE_GRAPHS", "ENGRAM_GRAPH_LOOKUPS", "ENGRAM_AIO",
           "ENGRAM_ATTN_PREFETCH", "ENGRAM_GIL_SWITCH_MS", "ENGRAM_SPLIT_GEMV", "ENGRAM_PDL", "ENGRAM_ATTENTION",
           "ENGRAM_FUSED", "ENGRAM_FUSED_GATE", "ENGRAM_READER", "ENGRAM_GATHER_CONFIG",
           "FIRST_LOOKUP_ALONE", "TOGETHER_WHEN_DEEP", "LATER_AT_FIRST_READ", "DISK_DECODE_IN_GRAPH", "CACHE_PROBE",
           "EARLY_HOST_IDS", "L2_PREFETCH", "kernel_switches", "wkv_run_ahead", "env_flag",
           "config_from_env", "cuda_graphs", "graph_slabs", "CPU_TOO")
# the server's in-process thread engine loop, deleted once the engine process won the H200 A/B (docs/log.md): its
# module, classes, the loop switch and its flag, as they would be spelled in the package or a benchmark
DELETED_LOOP = (r"\basync_engine\b", r"\bAsyncEngine\b", r"\bEngineBridge\b", r"\bENGINE_LOOPS\b",
                r"\bengine_loop\s*=(?!=)", r"\bengine_loop\s*:\s*str\b", r"--engine-loop\b", r"\bargs\.engine_loop\b")
SOURCES = PACKAGE + sorted((ROOT / "benchmarks").rglob("*.py")) + [ROOT / "benchmarks" / "suite.toml"]
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
TIMING = re.compile(r"\b\d+(?:\.\d+)? ?(?:ms|µs|us|ns)\b")


def _text(path: Path) -> str:
    return path.read_text()


def test_at_most_six_variables_each_read_only_in_envs():
    assert len(envs.VARIABLES) <= 6
    readers = [str(p.relative_to(ROOT)) for p in PACKAGE if p.name != "envs.py"
               and re.search(r"os\.environ\.get|os\.getenv|os\.environ\[", _text(p))]
    assert not readers, f"only engram/envs.py reads the environment: {readers}"


def test_every_engram_variable_named_in_the_package_is_registered():
    named = {m for p in PACKAGE for m in re.findall(r"\bENGRAM_[A-Z][A-Z_]*\b", _text(p))}
    constants = {"ENGRAM_EXTRA_COST", "ENGRAM_TABLE_KEYS"}  # Python names, not variables
    assert named - constants <= set(envs.VARIABLES), sorted(named - constants - set(envs.VARIABLES))


@pytest.mark.parametrize("name", DELETED)
def test_deleted_switch_stays_deleted(name):
    hits = [str(p.relative_to(ROOT)) for p in PACKAGE if re.search(rf"\b{name}\b", _text(p))]
    assert not hits, f"{name} is back in {hits}"


@pytest.mark.parametrize("pattern", DELETED_LOOP)
def test_deleted_thread_engine_loop_stays_deleted(pattern):
    hits = [f"{p.relative_to(ROOT)}: {m.group()}" for p in SOURCES for m in re.finditer(pattern, _text(p))]
    assert not hits, f"the thread engine loop is back: {hits}"


def test_kernel_choices_parse_and_bad_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("ENGRAM_KERNELS", "torch")
    assert envs.kernel_choice("attention") == "torch" and envs.kernel_choice("reader") == "auto"
    monkeypatch.setenv("ENGRAM_KERNELS", "attention=torch,reader=python")
    assert (envs.kernel_choice("attention"), envs.kernel_choice("gate"), envs.kernel_choice("reader")) == (
        "torch", "auto", "python")
    monkeypatch.setenv("ENGRAM_KERNELS", "attention=torch,warp=fast")
    with pytest.raises(ValueError, match="ENGRAM_KERNELS"):
        envs.kernel_choice("attention")
    monkeypatch.setenv("ENGRAM_KERNELS", "fastest")
    with pytest.raises(ValueError, match="ENGRAM_KERNELS"):
        envs.kernel_choice("gather")


def test_no_commit_hashes_or_timings_in_code_comments():
    found = []
    for p in PACKAGE:
        for tok in tokenize.generate_tokens(io.StringIO(_text(p)).readline):
            if tok.type in (tokenize.COMMENT, tokenize.STRING):
                for rx in (HASH, TIMING):
                    found += [f"{p.relative_to(ROOT)}:{tok.start[0]}: {m.group()}" for m in rx.finditer(tok.string)]
    assert not found, found
