"""Tests of pagegate.engine.loading."""
