"""Transports move bytes only: no msgpack, no framing (``tests/test_layering.py``)."""
