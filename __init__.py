"""pdserve: disaggregated prefill/decode LLM serving over a paged KV cache.

The offline API mirrors vLLM's: ``from pdserve import LLM, SamplingParams``.
"""

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
