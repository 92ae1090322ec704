"""A calibration run's settings and its resumable state: :class:`~.calibration_config.
CalibrationConfig` (:mod:`.calibration_config`), the run cache
(:class:`~.store.RunStore`, SQLite, :mod:`.store`) and the lock that allows one calibration
per output (:mod:`.lock`).

May import: ``abstain_guard.backends``, ``abstain_guard.scorers``, ``abstain_guard.contract``,
``abstain_guard.config``, ``abstain_guard.errors``.
"""
