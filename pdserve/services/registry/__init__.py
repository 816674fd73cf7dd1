"""The block registry service: pods heartbeat in, the router asks who is alive (docs/design.md §3)."""
