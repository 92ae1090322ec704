"""The guarantee: from calibration scores, labels and a target to the rule the guard applies
and the certificate it carries. Pure numpy / scipy; nothing here runs a model, holds an
artifact or reads a response.

* :mod:`.conformal` — participation thresholds and intervals (the conformal rank), the
  conditional correctness bound, the risk threshold (paper §3);
* :mod:`.risk_control` — the multiple-testing procedures behind risk mode, over ranks;
* :mod:`.selection` — choosing the scorer among candidates without spending δ;
* :mod:`.frontier` — which risk targets a calibration set can certify;
* :mod:`.decision` — :class:`~.decision.DecisionRule`: a config and the scores → τ and its
  guarantee;
* :mod:`.groups` — one rule per group of questions (Mondrian calibration);
* :mod:`.agent_steps` — the running-maximum statistic of a step-gated agent run;
* :mod:`.action_risk` — the probability that a wrong tool call is executed;
* :mod:`.partial_release` — the probability that a certified stream shows text and stops;
* :mod:`.intervals` — the Wilson interval every report of a rate uses;
* :mod:`.in_distribution` — the two-sample check of live against stored sampled scores;
* :mod:`.validation` — the one validator of scores and labels.

May import: ``abstain_guard.config``, ``abstain_guard.errors`` (the rule for every package:
``tests/unit/package/test_layout.py``).
"""
