"""Helpers of the bundle fuzz campaign (tests/test_fuzz_bundle.py): mutations, workers, pool."""
