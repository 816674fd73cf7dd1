"""The router: OpenAI-compatible REST gateway of the ensemble (DESIGN.md §3)."""
