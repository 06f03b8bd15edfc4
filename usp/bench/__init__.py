"""Measurement and checking code behind the scripts in ``tools/`` (which stay thin)."""
