"""Redis coordination backend for icefloe."""
