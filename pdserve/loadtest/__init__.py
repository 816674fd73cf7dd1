"""pdserve's load-test suite (``pdserve bench``): vLLM-compatible serving benchmarks against any
OpenAI-compatible server, rate sweeps with SLO capacity, a mock server, and disaggregated-versus-
colocated comparisons. See pdserve/loadtest/README.md."""
