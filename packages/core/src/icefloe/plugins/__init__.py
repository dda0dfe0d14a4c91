"""The ``icefloe`` plugin manager and the configured backend's lookup."""
