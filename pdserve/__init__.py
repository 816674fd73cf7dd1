"""pdserve: disaggregated prefill/decode LLM serving over a paged KV cache.

The offline API mirrors vLLM's: ``from pdserve import LLM, SamplingParams``.
"""

import os as _os

# Thread policy for shared CPUs: OpenMP threads that finish a parallel region sleep instead of spinning.
# With spinning (libgomp's default) a 2-thread decode step on a busy 2-core machine spent ~5x the CPU of a
# 1-thread one, siblings spinning at every barrier while the other was descheduled; passive measured
# ~1.2x the 1-thread CPU at ~0.6x its wall time (pdserve/loadtest/README.md "Offline throughput"). libgomp reads
# this when it loads, so it must be set before torch is imported; an explicit setting wins.
# ENV_SET_ON_IMPORT names what this import added, so benchmarks can leave it out of other projects' servers.
ENV_SET_ON_IMPORT = () if "OMP_WAIT_POLICY" in _os.environ else ("OMP_WAIT_POLICY",)
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name):
    # Lazy so that `import pdserve.services...` in a light process does not import torch.
    if name == "LLM":
        from pdserve.shared.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pdserve.shared.protocol.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from pdserve.shared.engine import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
