"""`GuardArtifact`: what calibration produces and the guard loads.

An artifact holds the fitted scorer's state, the calibration scores and labels (so a new
target in the config re-thresholds instantly, with no model run), the model fingerprint
and free JSON metadata. On disk it is a directory::

    manifest.json      schema_version, created, model_fingerprint, scorer kind,
                       sha256 checksums and sizes of every other file, metadata,
                       and manifest_sha256 (a checksum of the manifest itself)
    calibration.npz    scores [n] float64, correct [n] bool   (allow_pickle=False),
                       and groups [n] unicode when calibration recorded each answer's
                       group (per-group rules, :mod:`abstain_guard.guarantee.groups`)
    scorer.json        ScorerState kind, params, names of its arrays and files
    scorer.npz         ScorerState arrays                      (allow_pickle=False)
    <raw files>        ScorerState files, e.g. calibrator.ubj (XGBoost)
    action_risk.npz    optional: statistic [n_runs] float64, the action statistic of every
                       calibration run, labeled or not (a step-gated agent:
                       :mod:`abstain_guard.guarantee.action_risk`)
    stream.npz         optional: first [n] float64, each answer's first-chunk score
                       (certified streaming: :mod:`abstain_guard.guarantee.partial_release`)

Loading never executes code: JSON, numpy arrays without pickle, and raw bytes handed to
the scorer's ``from_state``. A missing file raises ArtifactNotFoundError, a changed or
truncated file ArtifactIntegrityError, an unknown schema or malformed content (a manifest
nested too deeply included) ArtifactSchemaError, an array that would inflate past
``max_array_bytes`` (default :data:`MAX_ARRAY_BYTES`, read from each ``.npy`` header before
anything is allocated) ArtifactTooLargeError, another model's artifact ArtifactMismatchError.

Saving is atomic and loading reads one consistent snapshot (readers never see a partial
artifact): the procedure is in :mod:`abstain_guard.artifact.files`. ``ledger.jsonl``, the
selection ledger (:mod:`abstain_guard.guarantee.ledger`), sits beside these files, outside
the checksums: it is appended to after publication; :meth:`GuardArtifact.save` carries it.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from abstain_guard._version import __version__
from abstain_guard.artifact.files import (
    ACTION_RISK,
    CALIBRATION,
    FORMAT_NAME,
    LEDGER,
    MANIFEST,
    MAX_ARRAY_BYTES,
    RESERVED_FILE_NAMES,
    REVIEW,
    SAFE_FILE_NAME,
    SCHEMA_VERSION,
    SCORER_JSON,
    SCORER_NPZ,
    STREAM,
    canonical_json,
    check_json,
    check_target,
    fsync_dir,
    load_npz,
    npz_bytes,
    parse_json,
    publish,
    sha256_hex,
    sweep_leftovers,
    validate_calibration,
    write_error,
    write_staging,
)
from abstain_guard.artifact.reading import append_ledger, read_consistent
from abstain_guard.config import GuardConfig
from abstain_guard.errors import (
    AbstainGuardError,
    ArtifactMismatchError,
    ArtifactSchemaError,
    InsufficientDataError,
    InvalidInputError,
)
from abstain_guard.guarantee.action_risk import check_action_statistics, require_action_statistics
from abstain_guard.guarantee.decision import DecisionRule, decision_rule
from abstain_guard.guarantee.groups import GroupRules, check_groups, group_rules, require_groups
from abstain_guard.guarantee.ledger import LedgerEntry, ledger_lines, parse_ledger
from abstain_guard.guarantee.partial_release import check_stream_statistics
from abstain_guard.guarantee.selection import ScorerSelection, recorded_selection
from abstain_guard.guarantee.truth import check_human_labels
from abstain_guard.scorers import Scorer, ScorerState, scorer_from_state

__all__ = ["MAX_ARRAY_BYTES", "SCHEMA_VERSION", "GuardArtifact"]

logger = logging.getLogger("abstain_guard")


class GuardArtifact:
    """A fitted scorer plus its calibration scores and labels.

    Build one with :meth:`from_calibration`, write it with :meth:`save`, read it with
    :meth:`load`, and ask it for the threshold of any target with :meth:`decision_rule`.

    Attributes:
        scorer: the fitted :class:`~abstain_guard.scorers.Scorer`.
        scores: calibration scores, shape ``[n]`` (float64).
        correct: calibration labels, shape ``[n]`` (bool).
        model_fingerprint: identity of the model the scores came from (or None).
        metadata: free JSON dict (judge identity, data set, split sizes, ...).
        groups: the group of each calibration answer, shape ``[n]`` (str), or None.
        action_statistic: every calibration run's action statistic, shape ``[n_runs]``
            (n_runs ≥ n: runs whose final answer was not labeled count too; float64,
            ``inf`` for a run without a wrong tool call), or None; needed for
            ``GuardConfig(action_risk_target=...)`` (:mod:`abstain_guard.guarantee.action_risk`).
        stream_first: each calibration answer's first-chunk score ``[n]`` (``inf``: none)
            when calibrated with a chunk rule (the scores are then the stream statistics,
            :mod:`abstain_guard.contract.streaming`), else None.
        selection: how the scorer was chosen (``metadata["selection"]``), with the ledger's
            looks joined (:class:`~abstain_guard.guarantee.selection.ScorerSelection`), or
            None (K = 1); every rule certifies at δ/K.
        ledger: the selection ledger's entries (``ledger.jsonl``).
        created: ISO-8601 UTC creation time.
        schema_version: the on-disk schema version.
        path: where it was loaded from or last saved to (None for an in-memory artifact).
    """

    def __init__(
        self,
        scorer: Scorer,
        scores: ArrayLike,
        correct: ArrayLike,
        model_fingerprint: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        created: str | None = None,
        groups: ArrayLike | None = None,
        action_statistic: ArrayLike | None = None,
        stream_first: ArrayLike | None = None,
        human: ArrayLike | None = None,
        ledger: Sequence[LedgerEntry] = (),
    ) -> None:
        if not isinstance(scorer, Scorer):
            raise InvalidInputError(
                f"scorer must be an abstain_guard Scorer, got {type(scorer).__name__}."
            )
        self.scorer = scorer
        self.scores, self.correct = validate_calibration(scores, correct)
        self.scores.setflags(write=False)
        self.correct.setflags(write=False)
        self.groups = None if groups is None else check_groups(groups, self.scores.size)
        if self.groups is not None:
            self.groups.setflags(write=False)
        self.action_statistic = (
            None
            if action_statistic is None
            else check_action_statistics(action_statistic)  # every run: may exceed n
        )
        self.stream_first = (
            None if stream_first is None else check_stream_statistics(stream_first, self.scores)[0]
        )
        self.human = None if human is None else check_human_labels(human, self.scores.size)
        if model_fingerprint is not None and not isinstance(model_fingerprint, str):
            raise InvalidInputError("model_fingerprint must be a string or None.")
        self.model_fingerprint = model_fingerprint
        meta = dict(metadata or {})
        check_json(meta, "metadata")
        self.metadata: dict[str, Any] = meta
        self.ledger = tuple(ledger)
        self.selection = self._selection()
        self.created = created or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        self.schema_version = SCHEMA_VERSION
        self.path: Path | None = None
        self._rules: dict[tuple[Any, ...], DecisionRule] = {}
        self._group_rules: dict[tuple[Any, ...], GroupRules] = {}

    @classmethod
    def from_calibration(
        cls,
        *,
        scorer: Scorer,
        scores: ArrayLike,
        correct: ArrayLike,
        model_fingerprint: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        groups: ArrayLike | None = None,
        action_statistic: ArrayLike | None = None,
        stream_first: ArrayLike | None = None,
        human: ArrayLike | None = None,
    ) -> GuardArtifact:
        """Create an artifact from a fitted scorer and its calibration scores and labels.

        Args (the attributes of the same names): scorer (the fitted scorer that produced
        ``scores``), scores ``[n]`` (finite), correct ``[n]`` (0/1 or bool),
        model_fingerprint (checked by the guard), metadata (free JSON, in the manifest),
        groups ``[n]`` (for ``GuardConfig(group_by=...)``), action_statistic ``[n_runs]``
        (every calibration run, labeled or not: for ``GuardConfig(action_risk_target=...)``),
        stream_first ``[n]`` (calibrated with a chunk rule: ``scores`` are the stream
        statistics), human ``[n]`` (people's verdicts on a uniformly random sample, -1 not
        reviewed: risk mode then certifies the true error rate,
        :mod:`abstain_guard.guarantee.truth`).
        """
        return cls(
            scorer,
            scores,
            correct,
            model_fingerprint=model_fingerprint,
            metadata=metadata,
            groups=groups,
            action_statistic=action_statistic,
            stream_first=stream_first,
            human=human,
        )

    @property
    def n(self) -> int:
        """Number of calibration samples."""
        return int(self.scores.size)

    @property
    def scorer_kind(self) -> str:
        """The scorer's registry kind."""
        return self.scorer.kind

    def decision_rule(self, config: GuardConfig | None = None) -> DecisionRule:
        """The threshold and guarantee for ``config``'s target, from the stored scores.

        Raises:
            ArtifactMismatchError: when ``config.scorer`` names another scorer kind.
            ActionRiskUnavailableError: ``config.action_risk_target`` is set and the
                artifact stores no action statistics.
        """
        cfg = config if config is not None else GuardConfig()
        if cfg.scorer is not None and cfg.scorer != self.scorer.kind:
            raise ArtifactMismatchError(
                f"The config asks for scorer {cfg.scorer!r} but this artifact was calibrated "
                f"with {self.scorer.kind!r}. Use an artifact for {cfg.scorer!r} or drop the "
                "scorer setting."
            )
        if cfg.action_risk_target is not None:
            require_action_statistics(self.action_statistic)
        key = cfg.rule_key()
        rule = self._rules.get(key)
        if rule is None:
            rule = decision_rule(
                self.scores,
                self.correct,
                cfg,
                selection=self.selection,
                action_statistic=self.action_statistic,
                stream_first=self.stream_first,
                human=self.human,
            )
            self._rules[key] = rule
        return rule

    @property
    def n_candidates(self) -> int:
        """K: the scorers this one was chosen among on its calibration answers, and every
        other one its ledger records on them (1: none)."""
        return 1 if self.selection is None else self.selection.n_candidates

    def _selection(self) -> ScorerSelection | None:
        """How the scorer was chosen (the metadata's block) with the ledger's looks joined."""
        block = self.metadata.get("selection")
        return recorded_selection(block, self.scorer.kind, self.n, self.ledger)

    def record_looks(self, entries: Sequence[LedgerEntry]) -> None:
        """Append ``entries`` to the selection ledger (on disk too when the artifact was loaded
        or saved) and count them in K from now on (:mod:`abstain_guard.guarantee.ledger`).

        Raises:
            ArtifactWriteError: the ledger file cannot be written (nothing is counted).
        """
        if self.path is not None:
            append_ledger(self.path, ledger_lines(entries))
        self.ledger = (*self.ledger, *entries)
        self.selection = self._selection()
        self._rules.clear()
        self._group_rules.clear()

    def group_rules(self, config: GuardConfig) -> GroupRules:
        """Each calibration group's rule for ``config`` (``config.group_by`` set), from the
        stored scores, labels and groups (:func:`abstain_guard.guarantee.groups.group_rules`).

        Raises:
            ArtifactMismatchError: the artifact records no calibration groups.
            InsufficientDataError: a group is too small and ``group_fallback="raise"``.
        """
        groups = require_groups(self.groups, config)
        key = config.rule_key()
        rules = self._group_rules.get(key)
        if rules is None:
            pooled = self.decision_rule(config)
            rules = group_rules(
                self.scores,
                self.correct,
                groups,
                config,
                pooled=pooled,
                selection=self.selection,
                human=self.human,
            )
            self._group_rules[key] = rules
        return rules

    def replace(
        self, *, metadata: Mapping[str, Any], human: ArrayLike | None = None
    ) -> GuardArtifact:
        """This artifact with other ``metadata`` (and ``human`` when given), all else kept."""
        return GuardArtifact(
            self.scorer,
            self.scores,
            self.correct,
            model_fingerprint=self.model_fingerprint,
            metadata=metadata,
            created=self.created,
            groups=self.groups,
            action_statistic=self.action_statistic,
            stream_first=self.stream_first,
            human=self.human if human is None else human,
            ledger=self.ledger,
        )

    def check_fingerprint(self, fingerprint: str | None) -> None:
        """Raise ArtifactMismatchError when both fingerprints are set and differ."""
        if fingerprint is None or self.model_fingerprint is None:
            return
        if str(fingerprint) != self.model_fingerprint:
            raise ArtifactMismatchError(
                f"This artifact was calibrated for model {self.model_fingerprint!r}, but the "
                f"model in use is {str(fingerprint)!r}. Its thresholds do not transfer to "
                "another model: calibrate again for this model, or load the matching model."
            )

    def __repr__(self) -> str:
        return (
            f"GuardArtifact(scorer={self.scorer.kind!r}, n={self.n}, "
            f"accuracy={float(self.correct.mean()):.3f}, "
            f"model_fingerprint={self.model_fingerprint!r})"
        )

    # --- save --------------------------------------------------------------------------

    def _files(self) -> dict[str, bytes]:
        state: ScorerState = self.scorer.get_state()
        if not isinstance(state, ScorerState):
            raise InvalidInputError(
                f"{type(self.scorer).__name__}.get_state() must return a ScorerState."
            )
        for name in state.files:
            if not SAFE_FILE_NAME.match(name) or name in RESERVED_FILE_NAMES:
                raise InvalidInputError(
                    f"Scorer file name {name!r} is not allowed (use letters, digits, '.', '_', "
                    f"'-', not one of {sorted(RESERVED_FILE_NAMES)})."
                )
        check_json(state.params, "ScorerState.params")
        scorer_json = {
            "kind": state.kind,
            "params": state.params,
            "arrays": sorted(state.arrays),
            "files": sorted(state.files),
        }
        calibration = {"scores": self.scores, "correct": self.correct}
        if self.groups is not None:
            calibration["groups"] = self.groups
        files: dict[str, bytes] = {
            CALIBRATION: npz_bytes(calibration),
            SCORER_JSON: json.dumps(scorer_json, indent=2, sort_keys=True).encode(),
            SCORER_NPZ: npz_bytes(state.arrays),
        }
        for name, data in state.files.items():
            files[name] = bytes(data)
        if self.action_statistic is not None:
            files[ACTION_RISK] = npz_bytes({"statistic": self.action_statistic})
        if self.stream_first is not None:
            files[STREAM] = npz_bytes({"first": self.stream_first})
        if self.human is not None:
            files[REVIEW] = npz_bytes({"human": self.human})
        return files

    def _manifest(self, files: Mapping[str, bytes]) -> dict[str, Any]:
        manifest: dict[str, Any] = {
            "format": FORMAT_NAME,
            "schema_version": SCHEMA_VERSION,
            "created": self.created,
            "library_version": __version__,
            "model_fingerprint": self.model_fingerprint,
            "scorer": {"kind": self.scorer.kind, "name": self.scorer.name},
            "n_calibration": self.n,
            "accuracy": float(self.correct.mean()),
            "checksums": {name: sha256_hex(data) for name, data in sorted(files.items())},
            "sizes": {name: len(data) for name, data in sorted(files.items())},
            "metadata": self.metadata,
        }
        if self.groups is not None:
            names, counts = np.unique(self.groups, return_counts=True)
            manifest["groups"] = {str(k): int(v) for k, v in zip(names, counts, strict=True)}
        manifest["manifest_sha256"] = sha256_hex(canonical_json(manifest))
        return manifest

    def save(self, path: str | os.PathLike[str], overwrite: bool = False) -> Path:
        """Write the artifact directory atomically (see the module docstring): a reader of
        ``path`` sees the complete old artifact or the complete new one, never a mix, and of
        concurrent saves the last to finish wins.

        Args:
            path: the directory to create.
            overwrite: replace an existing artifact directory at ``path``. A non-empty
                directory that is not an artifact is never replaced.

        Returns:
            The directory path.

        Raises:
            ArtifactError: ``path`` exists and may not be replaced.
            ArtifactWriteError: the files could not be written (read-only or full disk, ...).
        """
        target = Path(path)
        check_target(target, overwrite)
        files = self._files()
        manifest = self._manifest(files)
        files[MANIFEST] = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
        if self.ledger:  # carried over, outside the checksums (it grows after publication)
            files[LEDGER] = ledger_lines(self.ledger).encode()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            sweep_leftovers(target)
            tmp = write_staging(target, files)
        except OSError as exc:
            raise write_error(target, exc) from exc
        try:
            publish(tmp, target, overwrite)
            fsync_dir(target.parent)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise write_error(target, exc) from exc
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.path = target
        return target

    # --- load --------------------------------------------------------------------------

    @classmethod
    def read_manifest(cls, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Read and verify ``manifest.json`` (schema and self-checksum) without loading data."""
        manifest, _ = read_consistent(Path(path), with_files=False)
        return manifest

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        expected_fingerprint: str | None = None,
        *,
        max_array_bytes: int | None = None,
    ) -> GuardArtifact:
        """Load and verify an artifact directory.

        Args:
            path: the directory written by :meth:`save`.
            expected_fingerprint: when given (and the artifact has a fingerprint), they
                must be equal.
            max_array_bytes: the most bytes the arrays of one ``.npz`` file may inflate to
                (default :data:`MAX_ARRAY_BYTES`, 512 MiB), checked before allocating.

        Raises:
            ArtifactNotFoundError: the directory or a file is missing.
            ArtifactIntegrityError: a file's checksum or size does not match the manifest.
            ArtifactSchemaError: unsupported schema version or malformed content.
            ArtifactTooLargeError: an array would inflate past ``max_array_bytes``.
            ArtifactMismatchError: the artifact belongs to another model.
        """
        root = Path(path)
        limit = MAX_ARRAY_BYTES if max_array_bytes is None else int(max_array_bytes)
        manifest, data = read_consistent(root, with_files=True)

        fingerprint = manifest.get("model_fingerprint")
        if fingerprint is not None and not isinstance(fingerprint, str):
            raise ArtifactSchemaError("manifest model_fingerprint must be a string or null.")

        calib = load_npz(data[CALIBRATION], CALIBRATION, limit)
        if set(calib) not in ({"scores", "correct"}, {"scores", "correct", "groups"}):
            raise ArtifactSchemaError(
                f"{CALIBRATION} must hold 'scores' and 'correct' (and optionally 'groups'), "
                f"has {sorted(calib)}."
            )
        action = None
        if ACTION_RISK in data:  # optional (artifacts before action risk have none)
            stored = load_npz(data[ACTION_RISK], ACTION_RISK, limit)
            if set(stored) != {"statistic"}:
                raise ArtifactSchemaError(
                    f"{ACTION_RISK} must hold 'statistic', has {sorted(stored)}."
                )
            action = stored["statistic"]
        first = None
        if STREAM in data:  # optional (calibrated with a chunk rule)
            stream = load_npz(data[STREAM], STREAM, limit)
            if set(stream) != {"first"}:
                raise ArtifactSchemaError(f"{STREAM} must hold 'first', has {sorted(stream)}.")
            first = stream["first"]
        human = None
        if REVIEW in data:  # optional (a reviewed sample was read back)
            review = load_npz(data[REVIEW], REVIEW, limit)
            if set(review) != {"human"}:
                raise ArtifactSchemaError(f"{REVIEW} must hold 'human', has {sorted(review)}.")
            human = review["human"]
        try:
            scorer_json = parse_json(data[SCORER_JSON], SCORER_JSON)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ArtifactSchemaError(f"{SCORER_JSON} is not valid JSON: {exc}") from exc
        if not isinstance(scorer_json, dict) or not isinstance(scorer_json.get("kind"), str):
            raise ArtifactSchemaError(f"{SCORER_JSON} must be an object with a string 'kind'.")
        arrays = load_npz(data[SCORER_NPZ], SCORER_NPZ, limit)
        if sorted(arrays) != sorted(scorer_json.get("arrays", [])):
            raise ArtifactSchemaError(
                f"{SCORER_NPZ} holds arrays {sorted(arrays)} but {SCORER_JSON} lists "
                f"{scorer_json.get('arrays')}."
            )
        file_names = scorer_json.get("files", [])
        if not isinstance(file_names, list) or any(n not in data for n in file_names):
            raise ArtifactSchemaError(
                f"{SCORER_JSON} lists scorer files {file_names!r} that the manifest does not."
            )
        params = scorer_json.get("params", {})
        if not isinstance(params, dict):
            raise ArtifactSchemaError(f"{SCORER_JSON} 'params' must be an object.")
        state = ScorerState(
            kind=scorer_json["kind"],
            params=params,
            arrays=arrays,
            files={n: data[n] for n in file_names},
        )
        manifest_kind = (manifest.get("scorer") or {}).get("kind")
        if manifest_kind != state.kind:
            raise ArtifactSchemaError(
                f"Manifest scorer kind {manifest_kind!r} differs from {SCORER_JSON} kind "
                f"{state.kind!r}."
            )
        try:
            scorer = scorer_from_state(state)
        except AbstainGuardError:
            raise
        except Exception as exc:
            raise ArtifactSchemaError(
                f"Could not rebuild the {state.kind!r} scorer from the artifact: {exc}"
            ) from exc
        metadata = manifest.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise ArtifactSchemaError("manifest metadata must be an object.")
        try:
            ledger = parse_ledger(data.get(LEDGER, b"").decode("utf-8", "replace"), LEDGER)
            artifact = cls(
                scorer,
                calib["scores"],
                calib["correct"],
                model_fingerprint=fingerprint,
                metadata=metadata,
                created=manifest.get("created"),
                groups=calib.get("groups"),
                action_statistic=action,
                stream_first=first,
                human=human,
                ledger=ledger,
            )
        except (InvalidInputError, InsufficientDataError) as exc:
            raise ArtifactSchemaError(f"Invalid calibration data in the artifact: {exc}") from exc
        artifact.path = root
        if expected_fingerprint is not None:
            if fingerprint is None:
                logger.warning(
                    "Artifact %s has no model fingerprint; cannot check it against %r.",
                    root,
                    expected_fingerprint,
                )
            artifact.check_fingerprint(expected_fingerprint)
        return artifact
