"""An outdated third-party icefloe backend (contract 1), used by icefloe's tests."""
