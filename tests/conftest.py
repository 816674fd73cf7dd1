"""Makes ``tests/support`` importable as ``support`` and its real-process fixtures available everywhere."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

pytest_plugins = ["support.fixtures", "support.model_fixtures", "support.tiers", "support.ssl_context"]
