"""Tests of pagegate.engine.sampling."""
