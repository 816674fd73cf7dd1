"""The router: OpenAI-compatible REST gateway of the ensemble (docs/design.md §3).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE when ``stream``), ``GET /v1/models``,
``POST /tokenize``, ``POST /detokenize``, ``GET /health``, ``GET /metrics``, ``GET /version``.

A request's path: ``schemas`` (types, ranges) -> ``params`` (cross-field rules, context length, sampling
parameters) and ``prompts`` (chat template, tokens) -> ``dispatch`` (decode pod from the registry, local or
remote prefill, XADD of ``PrefillRequest``s) -> ``relay`` (XREAD of the output streams, abort) ->
``responses`` (OpenAI bodies and chunks). ``app`` wires them into FastAPI; ``main`` is ``pdserve router``.
"""
