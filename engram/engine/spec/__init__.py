"""Speculative decoding: the config and its decode reservation, the proposers (n-gram prompt lookup on the engine's
CPU, a draft model on the Worker) and the verification of K + 1 positions per sequence (docs/engine.md)."""
