"""Every exception abstain_guard raises, in one place.

Each class says *what kind* of thing went wrong; each message says what was wrong and
what to do next. All derive from :class:`AbstainGuardError`, so ``except
AbstainGuardError`` catches everything the library raises on purpose. Classes that are
also ordinary input errors additionally derive from :class:`ValueError`.
"""

from __future__ import annotations


class AbstainGuardError(Exception):
    """Base class of every error raised by abstain_guard."""


# --- input validation ------------------------------------------------------------------


class InvalidInputError(AbstainGuardError, ValueError):
    """An argument has the wrong type, shape, range or value (NaN scores, alpha outside (0, 1))."""


class InsufficientDataError(AbstainGuardError, ValueError):
    """Too few samples (or only one class) to compute what was asked for."""


class UncertifiableTargetError(InsufficientDataError):
    """A risk target below what the calibration data can certify (at that delta).

    Attributes:
        smallest_risk_target: the smallest risk target this calibration set certifies at
            the requested delta (``None`` when it certifies none below 1).
    """

    def __init__(self, message: str, smallest_risk_target: float | None = None) -> None:
        super().__init__(message)
        self.smallest_risk_target = smallest_risk_target


class NotFittedError(AbstainGuardError, RuntimeError):
    """A scorer or calibrator was used before ``fit`` was called."""


class ConfigError(AbstainGuardError, ValueError):
    """A configuration file, environment variable or option is malformed or unknown."""


class MissingExtraError(AbstainGuardError, ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""


# --- models ----------------------------------------------------------------------------


class ModelError(AbstainGuardError):
    """Base class of model loading and generation errors."""


class ModelNotFoundError(ModelError, FileNotFoundError):
    """The model files are not installed or not where they were said to be."""


class ModelNameError(ModelError, ConfigError):
    """A model name (``--model``, ``model:``) is malformed, takes options that do not apply to
    it, or is ambiguous (a server serving several models, none named)."""


class UnsupportedArchitectureError(ModelError, ValueError):
    """Geometry capture does not support this model architecture."""


class ContextLengthError(ModelError, InvalidInputError):
    """The prompt (plus the requested new tokens) does not fit the model's context window."""


class SchedulerFullError(ModelError, RuntimeError):
    """A chat model's request queue is full: too many concurrent calls are waiting for the
    model. Retry later, send fewer concurrent calls, or raise ``max_queue``."""


# --- scoring and guarding --------------------------------------------------------------


class BackendError(ModelError, RuntimeError):
    """A generation backend cannot be started or reached, or answered with an error (the
    vLLM engine: :mod:`abstain_guard.backends`)."""


class ScoringError(AbstainGuardError):
    """A scorer could not score a response (missing logprobs or geometry, NaN features)."""


class CaptureModeError(ScoringError):
    """The response's geometry was captured in another mode ("full" / "fast") than the one
    the scorer was fitted on; features of the two modes must never be mixed."""


class BackendCapabilityError(ScoringError):
    """The scorer reads something the backend that generated the response does not provide
    (geometry on the vLLM backend: it is computed only by the project's exact engine)."""


class ConfidenceParseError(ScoringError):
    """A verbalized-confidence reply states no single confidence from 0 to 100 (a refusal,
    a range, another scale): the answer cannot be scored and the guard abstains."""


class GuardError(AbstainGuardError):
    """The guard could not reach a decision and is configured to raise (``on_error="raise"``)."""


# --- artifacts -------------------------------------------------------------------------


class ArtifactError(AbstainGuardError):
    """Base class of artifact errors."""


class ArtifactNotFoundError(ArtifactError, FileNotFoundError):
    """The artifact directory or one of its files is missing."""


class ArtifactIntegrityError(ArtifactError):
    """A file's checksum does not match the manifest: the artifact was modified or truncated."""


class ArtifactSchemaError(ArtifactError):
    """The artifact was written with an unsupported schema version or has a malformed manifest."""


class ArtifactMismatchError(ArtifactError):
    """The artifact was calibrated for a different model (fingerprint mismatch) or scorer."""


class SamplingMismatchError(ArtifactMismatchError):
    """The answers were sampled otherwise than at calibration (k, temperature, how the
    primary answer is chosen, the confidence prompt), or the similarity model that compares
    them has other weights: deploy with the calibrated sampling plan and model, or
    recalibrate."""


class GivenAnswerError(ArtifactMismatchError):
    """The guard cannot score an answer it did not generate (``AbstentionGuard.check``,
    ``abstain-guard score``): its scorer reads what no re-reading of the answer gives (the
    message names the scorers that can), or a chat model it guards cannot re-read one."""


class ActionRiskUnavailableError(ArtifactMismatchError):
    """The config asks for an action-risk target but the artifact stores no action
    statistics (calibrated before action risk, not a step-gated agent, or on rows without
    expected tool calls): recalibrate with ``abstain-guard calibrate --agent``."""


class ArtifactTooLargeError(ArtifactSchemaError):
    """An artifact array would inflate past the load limit (``max_array_bytes``)."""


class ArtifactWriteError(ArtifactError):
    """An artifact could not be written (read-only or full disk, a concurrent writer, ...)."""


# --- calibration -----------------------------------------------------------------------


class DatasetError(AbstainGuardError, ValueError):
    """A data set file is missing, unreadable, or has no usable rows."""


class JudgeError(AbstainGuardError):
    """A correctness judge is unknown, misconfigured, or failed permanently."""


class CalibrationError(AbstainGuardError):
    """The calibration pipeline cannot proceed (see the message for the step and the fix)."""


class CalibrationLockedError(CalibrationError):
    """Another calibration run holds the lock on the same output or cache directory.

    Attributes:
        pid: the process id recorded by the run holding the lock (``None`` if unreadable).
        lock_path: the lock file.
    """

    def __init__(self, message: str, pid: int | None = None, lock_path: str = "") -> None:
        super().__init__(message)
        self.pid = pid
        self.lock_path = lock_path


class LogprobsMissingError(CalibrationError):
    """An API chat model answered a calibration question without per-token logprobs, which
    the likelihood scorers read (the message names the question and the option to set)."""


class DistributedChunkError(CalibrationError):
    """Chunks of a ``calibrate --executor ray`` run kept failing on the Ray workers (after
    Ray's restarts and retries); everything else the run finished is cached.

    Attributes:
        failures: ``(what, question ids, cause)`` per failed chunk.
    """

    def __init__(self, failures: list[tuple[str, list[str], str]]) -> None:
        self.failures = failures
        parts = [
            f"{what} (questions {', '.join(ids[:8])}{' ...' if len(ids) > 8 else ''}): {cause}"
            for what, ids, cause in failures
        ]
        super().__init__(
            f"{len(failures)} chunks failed on the Ray workers after retries: "
            + "; ".join(parts)
            + ". Everything else is cached: fix the cause (worker memory, a node without the "
            "model files) and run the same command again; only these chunks are redone."
        )


class CacheError(CalibrationError):
    """A run or judgment cache (SQLite) is not a database, is damaged, truncated or edited."""


class JudgmentCacheError(CacheError, JudgeError):
    """The judgment cache is damaged (also a :class:`JudgeError`: a judge's failure)."""


# --- command line and run preflight ------------------------------------------------------


class OutputPathError(ConfigError):
    """An output or cache location cannot be used: it is a file, a non-empty directory that
    is not an artifact, or under a directory that cannot be written."""


class ResultsFileError(AbstainGuardError, ValueError):
    """A file given as ``results.json`` (``abstain-guard report --results``) is not one written
    by ``abstain-guard evaluate``."""


class PreflightError(AbstainGuardError, ValueError):
    """Several problems found before any model was loaded, reported together.

    Attributes:
        errors: the individual errors (each a typed :class:`AbstainGuardError`).
    """

    def __init__(self, errors: list[AbstainGuardError]) -> None:
        self.errors = list(errors)
        lines = "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(
            f"{len(self.errors)} problems found before loading the model; fix them all and "
            f"run again:\n{lines}"
        )


# --- monitoring and feedback ---------------------------------------------------------------


class FeedbackError(AbstainGuardError, ValueError):
    """Feedback the monitor refuses (base class)."""


class UnknownRunError(FeedbackError, KeyError):
    """Feedback names a run id the monitor never recorded (or dropped as too old)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DuplicateFeedbackError(FeedbackError):
    """Feedback for a run id that already has feedback: each decision is labeled once."""


class MonitorLogError(AbstainGuardError, ValueError):
    """A monitor log (``GuardMonitor.write_log`` / ``log_path``) is malformed, or belongs to
    another artifact than the one it is used with."""


class DecisionJournalError(AbstainGuardError, OSError):
    """A served decision could not be written to (or replayed from) the server's decision
    journal (``<monitor-log>.journal``, :mod:`abstain_guard.serve.journal`)."""


class MonitorUnavailableError(AbstainGuardError, RuntimeError):
    """The drift monitor of a Ray Serve deployment (its monitor actor) did not answer in
    time or is gone; the request is answered 503 with ``Retry-After``."""


# --- warnings --------------------------------------------------------------------------


class KernelMismatchWarning(UserWarning):
    """A guarded response was computed on other CPU / GPU kernels than the calibration
    (:mod:`abstain_guard.contract.kernels`): its score may differ from what calibration would have
    stored in its last bits. Given once per guard, with the stated tolerance and the number
    of calibration scores close enough to the threshold to flip."""
