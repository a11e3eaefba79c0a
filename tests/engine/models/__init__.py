"""Tests of pagegate.engine.models."""
