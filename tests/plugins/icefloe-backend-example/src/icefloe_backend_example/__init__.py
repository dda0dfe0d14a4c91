"""Example third-party icefloe backend (a file-based channel), used by icefloe's tests."""
