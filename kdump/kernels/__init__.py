"""Kernel entry points on the replay side: specs (argument roles, contract, reference,
generators), and backends that run a call (installed library, packaged kernel, torch reference)."""
