"""Shared test configs for the pipeline planner."""
import json

from engram.configs import shipped_config_path

# DeepSeek-V4.1-Flash (40 decoder layers): the shipped layout file, whose published numbers
# tests/unit/test_configs.py pins field by field.
V41_FLASH = json.loads(shipped_config_path("deepseek-v4.1-flash").read_text(encoding="utf-8"))
