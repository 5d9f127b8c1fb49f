"""Kernel libraries as plug-ins (plugin.py, found by registry.py; DeepGEMM in deepgemm/): specs
(argument roles, contract, reference, generators, in spec.py), and backends that run a call
(installed library, packaged kernel, torch reference, the recorded target: generic.py)."""
