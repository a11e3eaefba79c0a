"""Tests of pagegate.engine.observe."""
