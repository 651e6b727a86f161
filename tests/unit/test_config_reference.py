"""docs/config.md's option tables are generated from the config dataclasses and engram/envs.py: this fails
when the code and the reference disagree (regenerate with ``python tools/config_reference.py``)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_config_reference_matches_the_dataclasses():
    run = subprocess.run([sys.executable, "tools/config_reference.py", "--check"], cwd=ROOT, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr


def test_every_option_and_variable_is_in_the_reference():
    import dataclasses

    from engram import envs
    from engram.engine.config import EngineConfig
    from engram.model.options import RuntimeOptions
    from engram.store.options import AdvancedOptions, StoreOptions

    doc = (ROOT / "docs" / "config.md").read_text()
    names = [f.name for cls in (EngineConfig, RuntimeOptions, StoreOptions) for f in dataclasses.fields(cls)
             if f.name != "store"]
    missing = [n for n in names + list(envs.VARIABLES) if f"`{n}`" not in doc]
    assert not missing, missing
    store = (ROOT / "docs" / "store.md").read_text()
    knobs = [f"`advanced.{f.name}`" for f in dataclasses.fields(AdvancedOptions)]
    assert all(k in store for k in knobs) and not any(k in doc for k in knobs)  # the knobs: docs/store.md only
