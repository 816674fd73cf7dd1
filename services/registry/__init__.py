"""The block registry service: pods heartbeat in, the router asks who is alive (DESIGN.md §3)."""
