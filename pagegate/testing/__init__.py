"""Helpers that tests and benchmarks share: a real server in a subprocess, oracles to check the engine against."""
