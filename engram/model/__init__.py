"""The reference decoder, its presets, loader and built-in tokenizer (see docs/model.md)."""
