"""Test oracles: plain, slow implementations that the fast paths are checked against. They live under
tests/ because nothing in the package may depend on them."""
