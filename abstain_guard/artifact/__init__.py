"""The artifact: what calibration writes and the guard loads — the fitted scorer's state, the
calibration scores and labels, the deployment record, the model fingerprint — and how it lives
on disk.

* :mod:`.guard_artifact` — :class:`~.guard_artifact.GuardArtifact`: the format, saving and
  loading, and the rules it rebuilds from what it stores (decision, groups, selection);
* :mod:`.calibration_set` — :class:`~.calibration_set.CalibrationSet`: the calibration
  answers' scores, labels and optional arrays, checked once;
* :mod:`.files` — file names (the optional side files in one table, ``SIDE_FILES``) and
  encodings (canonical JSON, ``.npz`` without pickle, size checks), atomic publication of a new
  version; :mod:`.reading` — reading one consistent snapshot.

May import: ``abstain_guard.scorers``, ``abstain_guard.guarantee``, ``abstain_guard.config``,
``abstain_guard.errors``, ``abstain_guard._version``.
"""
