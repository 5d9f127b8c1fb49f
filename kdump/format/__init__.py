"""The bundle and journal formats in code, torch-free: constants and typed records (`records`),
the header and manifest parser (`parse`) and the one validation pass (`validate`).

docs/FORMAT.md is the normative description; every writer and reader builds or reads these
records.
"""
