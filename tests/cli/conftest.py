from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/support

from support.fixtures import redis_server, redis_url  # noqa: E402,F401
