"""The ``icefloe`` command line (``main`` assembles it; the commands are plugins' too)."""
