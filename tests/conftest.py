"""Hypothesis profiles: random exploration by default (a new run may find a new case); `HYPOTHESIS_PROFILE=ci`
(set by .ci/run) derandomizes, so CI's outcome depends on the commit alone, not on the draw."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
