"""One call at a time per optimizer. The engine serialises its own calls, but one call here (a step, a
state_dict) is several engine calls that must all see the same state: a state_dict taken on another thread
during a step is then the state before that step or after it, never a mix."""
from __future__ import annotations

import functools


def serialised(method):
    """Runs ``method`` holding its optimizer's ``_calls`` lock (re-entrant: a call may make another, and
    the closure of ``step(closure)`` may read the optimizer). Gradient hooks do not take it: on a GPU they
    run on autograd's device thread while ``step(closure)`` holds it."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._calls:
            return method(self, *args, **kwargs)
    return call
