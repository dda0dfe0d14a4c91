"""PostgreSQL coordination backend for icefloe."""
