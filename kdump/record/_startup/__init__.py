"""Holds kdump's sitecustomize.py; this folder (not the package) goes on PYTHONPATH."""
