"""icefloe plugin entry point (hook implementations)."""
