"""The bundle and journal formats in code, torch-free: constants and typed records (`records`),
the argument tree (`argtree`), the dtype names (`dtypes`, torch imported on first use), the
header and manifest parser (`parse`), the one validation pass (`validate`), the flight
recorder's journal layout and slot records (`journal`) and the synthetic-data generator of
slimmed bundles (`synthetic`, numpy only).

docs/FORMAT.md is the normative description; every writer and reader builds or reads these
records.
"""
