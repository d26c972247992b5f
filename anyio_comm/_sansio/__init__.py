"""The sans-IO core of anyio-comm: wire format, frame decoder, serialization.

Nothing in this package imports anyio, socket or ssl (``tests/test_layering.py``
checks it), so all of it is tested without an event loop.
"""
