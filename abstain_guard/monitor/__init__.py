"""The drift monitor: is a deployed guard's guarantee still holding?

* :mod:`.guard_monitor` — :class:`~.guard_monitor.GuardMonitor`: fed every decision (and, where
  known, whether an answer was right), it runs three anytime-valid tests and raises alarms;
* :mod:`.drift` — the tests: the conformal test martingale and the participation and risk
  e-processes;
* :mod:`.scope` — one scope's three tests (every decision, or one group's) and the alarm;
* :mod:`.state` — what the monitor reports, as functions of its scopes;
* :mod:`.log` — the monitor log (JSONL) and its reader; :mod:`.resume` — writing it as
  decisions come and resuming a monitor from it;
* :mod:`.binding` — a monitor bound to a guard: fitted on its artifact and rule;
* :mod:`.report` — the monitor's history as time series, and the page that draws them
  (``serve``'s ``/dashboard``, ``abstain-guard monitor report``).

May import: ``abstain_guard.artifact``, ``abstain_guard.guarantee``, ``abstain_guard.config``,
``abstain_guard.errors``.
"""
