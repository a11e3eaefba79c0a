"""Tests of pagegate.core.seed."""
