"""The drift monitor's memory per decision, measured with ``tracemalloc``, and the cost of
one rank-test update against the size of its history (no model).

A :class:`~abstain_guard.GuardMonitor` fitted on 1000 calibration scores
(participation 0.8) observes live decisions of Beta(2, 5) scores, each labeled. Two figures:

* ``history_bytes_per_decision``: what the exchangeability test keeps per scored decision
  for ever (one float in a ``SortedList``: valid conformal p-values rank each live score
  among *all* earlier scores, so the history cannot be bounded without changing the test);
* ``monitor_bytes_per_decision``: everything the monitor keeps per decision while it holds
  fewer than ``max_records`` (default 100 000) decisions: the history plus the decision's
  record (run id, times, score, feedback) kept for feedback; beyond ``max_records`` the
  oldest records are dropped and only the history grows;
* ``update_us_at_history``: microseconds per rank-test update (p-value, bet, insert) after
  a thousand and after a million earlier scores (best of 8 batches of 250).

Run::

    .venv/bin/python experiments/drift/monitor_memory.py
"""

from __future__ import annotations

import gc
import json
import time
import tracemalloc
import uuid
from typing import Any

import numpy as np

from abstain_guard.guarantee.certificate import Certificate
from abstain_guard.guarantee.conformal import participation_threshold
from abstain_guard.guarantee.decision import Decision, DecisionRule
from abstain_guard.monitor.drift import ConformalTestMartingale
from abstain_guard.monitor.guard_monitor import GuardMonitor


def _grown(update: object, live: np.ndarray) -> float:
    """Bytes allocated and still held per call of ``update(score)`` over ``live`` ``[m]``."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for s in live:
        update(float(s))  # type: ignore[operator]
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return grown / live.size


def _update_us(history: int, updates: int = 2000) -> float:
    """Microseconds per :meth:`ConformalTestMartingale.update` after ``history`` scores."""
    rng = np.random.default_rng(history)
    martingale = ConformalTestMartingale(rng.normal(size=history), rng=rng)
    best = float("inf")
    for batch in np.array_split(rng.normal(size=updates), 8):
        start = time.perf_counter()
        for s in batch.tolist():
            martingale.update(s)
        best = min(best, (time.perf_counter() - start) / batch.size)
    return round(best * 1e6, 1)


def main(decisions: int = 50_000, n: int = 1000) -> dict[str, Any]:
    """The two figures of the module docstring, for ``decisions`` live scores."""
    rng = np.random.default_rng(0)
    reference = rng.beta(2, 5, size=n)
    live = rng.beta(2, 5, size=decisions)
    martingale = ConformalTestMartingale(reference, rng=rng)
    history = _grown(martingale.update, live)
    tau = participation_threshold(reference, 0.2)
    certificate = Certificate(kind="participation", statement="", rank=tau.rank)
    rule = DecisionRule(tau.threshold, "participation", 0.8, certificate)
    monitor = GuardMonitor(seed=0).fit(reference, rule)

    def observe(score: float) -> None:
        rid = monitor.observe(Decision(abstained=score > tau.threshold, score=score),
                              run_id=f"chatcmpl-{uuid.uuid4().hex}")  # fmt: skip
        monitor.record_feedback(rid, correct=True)

    whole = _grown(observe, live)
    return {
        "decisions": decisions,
        "history_bytes_per_decision": round(history, 1),
        "monitor_bytes_per_decision": round(whole, 1),
        "update_us_at_history": {str(h): _update_us(h) for h in (1_000, 1_000_000)},
    }


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
