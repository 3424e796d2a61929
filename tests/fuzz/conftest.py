"""Bounded property-based fuzzing (hypothesis) of what Transom reads from others.

The coordinator API (bodies from the network, sequences of calls from token holders), the
checkpoint manifest (JSON from storage) and the peer state format (bytes from a peer). Each
property says what must never happen: a 5xx, an exception other than the documented one, a
recorded step no replica can have committed. Runs in CI with a fixed seed and a bounded
number of examples (profile "ci"); `HYPOTHESIS_PROFILE=deep` searches longer, locally.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

settings.register_profile("ci", max_examples=150, deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deep", max_examples=5000, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=24))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                    max_size=4), max_leaves=24)
