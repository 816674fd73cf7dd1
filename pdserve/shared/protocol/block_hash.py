"""Block hashes for automatic prefix caching — importable without torch (the router uses it too).

A block hash chains the parent block's hash with the block's token ids, so equal hashes mean an
equal whole prefix (vLLM v1, ``hash_block_tokens``). ``cache_salt`` enters the first block only and
thereby every later hash through the chain: tenants with different salts never share a block.
Only full blocks are hashed. SHA-256 truncated to 128 bits: collisions are not a practical concern
and the digest is stable across processes and machines (Python's ``hash`` is not).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

_ROOT = b"pdserve-block-hash-v1"


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], cache_salt: str | None = None) -> BlockHash:
    """Hash of one full block: ``sha256(parent | salt | token ids as little-endian u32)[:16]``."""
    h = hashlib.sha256(parent if parent is not None else _ROOT)
    if parent is None and cache_salt:
        h.update(b"salt:" + cache_salt.encode())
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.digest()[:16]


def compute_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    parent_hashes: list[BlockHash] | None = None,
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``; extends ``parent_hashes`` when given (in place).

    ``parent_hashes`` are the hashes already known for the leading blocks: only the rest are computed,
    so a growing sequence pays for each block once.
    """
    hashes = parent_hashes if parent_hashes is not None else []
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], cache_salt))
    return hashes
