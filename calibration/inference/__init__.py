"""Scorers that run when the guard answers: the geometry scorer with its XGBoost
calibrator, and the model-based baselines. The guard loads them from an artifact through
the scorer registry (:mod:`abstain_guard.scoring`)."""
