"""`GuardArtifact`: what calibration produces and the guard loads: the fitted scorer's state,
the calibration set (so a new target re-thresholds with no model run), the model
fingerprint and free JSON metadata, as a directory that loading reads without executing
code, atomically saved (the format, its errors and the save procedure:
docs/architecture.md, "Artifact").
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from abstain_guard._version import __version__
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.artifact.files import (
    CALIBRATION,
    FORMAT_NAME,
    LEDGER,
    MANIFEST,
    MAX_ARRAY_BYTES,
    RESERVED_FILE_NAMES,
    SAFE_FILE_NAME,
    SCHEMA_VERSION,
    SCORER_JSON,
    SCORER_NPZ,
    SIDE_FILES,
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
from abstain_guard.guarantee.action_risk import require_action_statistics
from abstain_guard.guarantee.decision import DecisionRule, decision_rule
from abstain_guard.guarantee.groups import GroupRules, group_rules, require_groups
from abstain_guard.guarantee.ledger import LedgerEntry, ledger_lines, parse_ledger
from abstain_guard.guarantee.selection import ScorerSelection, recorded_selection
from abstain_guard.scorers import Scorer, ScorerState, require_answer_route, scorer_from_state

logger = logging.getLogger("abstain_guard")


class GuardArtifact:
    """A fitted scorer plus its calibration set: build one with :meth:`from_calibration`,
    :meth:`save` and :meth:`load` it, and ask it for any target's rule (:meth:`decision_rule`).

    Attributes:
        scorer, calibration: the fitted scorer and the
            :class:`~abstain_guard.artifact.calibration_set.CalibrationSet` (its arrays read
            as the artifact's attributes too).
        model_fingerprint, metadata, created: the model's identity (or None), free JSON and
            the ISO-8601 UTC creation time.
        selection, ledger: how the scorer was chosen, with the ledger's looks joined (None:
            K = 1), and the ledger's entries.
        path: where it was loaded from or last saved to (None: in memory).
    """

    def __init__(
        self,
        scorer: Scorer,
        calibration: CalibrationSet,
        *,
        model_fingerprint: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        created: str | None = None,
        ledger: Sequence[LedgerEntry] = (),
    ) -> None:
        if not isinstance(scorer, Scorer):
            raise InvalidInputError(
                f"scorer must be an abstain_guard Scorer, got {type(scorer).__name__}."
            )
        if not isinstance(calibration, CalibrationSet):
            raise InvalidInputError(
                f"calibration must be a CalibrationSet, got {type(calibration).__name__}."
            )
        self.scorer = scorer
        self.calibration = calibration
        if model_fingerprint is not None and not isinstance(model_fingerprint, str):
            raise InvalidInputError("model_fingerprint must be a string or None.")
        self.model_fingerprint = model_fingerprint
        meta = dict(metadata or {})
        check_json(meta, "metadata")
        self.metadata: dict[str, Any] = meta
        self.ledger = tuple(ledger)
        self.selection = self._selection()
        self.created = created or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        self.path: Path | None = None
        self.digest: str | None = None  # the manifest's sha256, once saved or loaded
        self._rules: dict[tuple[Any, ...], DecisionRule] = {}
        self._group_rules: dict[tuple[Any, ...], GroupRules] = {}

    @classmethod
    def from_calibration(
        cls,
        *,
        scorer: Scorer,
        calibration: CalibrationSet,
        model_fingerprint: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> GuardArtifact:
        """A new artifact from a fitted scorer and the calibration set it scored."""
        return cls(scorer, calibration, model_fingerprint=model_fingerprint, metadata=metadata)

    @property
    def scores(self) -> np.ndarray:
        return self.calibration.scores

    @property
    def correct(self) -> np.ndarray:
        return self.calibration.correct

    @property
    def groups(self) -> np.ndarray | None:
        return self.calibration.groups

    @property
    def action_statistic(self) -> np.ndarray | None:
        return self.calibration.action_statistic

    @property
    def stream_first(self) -> np.ndarray | None:
        return self.calibration.stream_first

    @property
    def human(self) -> np.ndarray | None:
        return self.calibration.human

    @property
    def n(self) -> int:
        return self.calibration.n

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
        """K: the scorers chosen among on these calibration answers and the ledger's others."""
        return 1 if self.selection is None else self.selection.n_candidates

    def _selection(self) -> ScorerSelection | None:
        block = self.metadata.get("selection")
        return recorded_selection(block, self.scorer.kind, self.n, self.ledger)

    def record_looks(self, entries: Sequence[LedgerEntry]) -> None:
        """Append ``entries`` to the selection ledger (on disk too, for a loaded or saved
        artifact) and count them in K from now on.

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
        """Each calibration group's rule for ``config`` (``config.group_by`` set;
        :func:`abstain_guard.guarantee.groups.group_rules`).

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
        self, *, metadata: Mapping[str, Any], human: np.ndarray | None = None
    ) -> GuardArtifact:
        """This artifact with other ``metadata`` (and ``human`` when given), all else kept."""
        calibration = self.calibration
        if human is not None:
            calibration = dataclasses.replace(calibration, human=human)
        return GuardArtifact(
            self.scorer,
            calibration,
            model_fingerprint=self.model_fingerprint,
            metadata=metadata,
            created=self.created,
            ledger=self.ledger,
        )

    def answer_route(self) -> str:
        """How its scorer scores an answer the guard did not generate: ``"replay"`` (a local
        model re-reads it) or ``"samples"`` (beside fresh samples).

        Raises:
            GivenAnswerError: the scorer cannot; the message names the kinds that can.
        """
        return require_answer_route(self.scorer)

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
        for side in SIDE_FILES:
            array = getattr(self.calibration, side.field)
            if array is not None:
                files[side.name] = npz_bytes({side.key: array})
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
        """Write the artifact directory atomically (a reader sees the old artifact or the new
        one, never a mix); ``overwrite`` replaces an existing artifact (never a non-empty
        directory that is not one). Returns the directory.

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
        self.path, self.digest = target, manifest["manifest_sha256"]
        return target

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
        """Load and verify an artifact directory: its fingerprint must equal
        ``expected_fingerprint`` when both are set; one ``.npz`` file's arrays may inflate to
        ``max_array_bytes`` at most (default :data:`MAX_ARRAY_BYTES`), checked before
        allocating.

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
        metadata = manifest.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise ArtifactSchemaError("manifest metadata must be an object.")
        scorer = _stored_scorer(manifest, data, limit)
        try:
            artifact = cls(
                scorer,
                _stored_calibration(data, limit),
                model_fingerprint=fingerprint,
                metadata=metadata,
                created=manifest.get("created"),
                ledger=parse_ledger(data.get(LEDGER, b"").decode("utf-8", "replace"), LEDGER),
            )
        except (InvalidInputError, InsufficientDataError) as exc:
            raise ArtifactSchemaError(f"Invalid calibration data in the artifact: {exc}") from exc
        artifact.path, artifact.digest = root, sha256_hex(canonical_json(manifest))
        if expected_fingerprint is not None:
            if fingerprint is None:
                logger.warning(
                    "Artifact %s has no model fingerprint; cannot check it against %r.",
                    root,
                    expected_fingerprint,
                )
            artifact.check_fingerprint(expected_fingerprint)
        return artifact


def _stored_calibration(data: Mapping[str, bytes], limit: int) -> CalibrationSet:
    """The calibration set from ``calibration.npz`` and the side files present.

    Raises:
        ArtifactSchemaError: a file holds other arrays than its own.
    """
    calib = load_npz(data[CALIBRATION], CALIBRATION, limit)
    if set(calib) not in ({"scores", "correct"}, {"scores", "correct", "groups"}):
        raise ArtifactSchemaError(
            f"{CALIBRATION} must hold 'scores' and 'correct' (and optionally 'groups'), "
            f"has {sorted(calib)}."
        )
    side_arrays: dict[str, np.ndarray] = {}
    for side in SIDE_FILES:
        if side.name not in data:
            continue
        stored = load_npz(data[side.name], side.name, limit)
        if set(stored) != {side.key}:
            raise ArtifactSchemaError(f"{side.name} must hold {side.key!r}, has {sorted(stored)}.")
        side_arrays[side.field] = stored[side.key]
    return CalibrationSet(
        calib["scores"], calib["correct"], groups=calib.get("groups"), **side_arrays
    )


def _stored_state(data: Mapping[str, bytes], limit: int) -> ScorerState:
    """The scorer's state from ``scorer.json``, ``scorer.npz`` and the raw files it lists.

    Raises:
        ArtifactSchemaError: malformed JSON, or files that disagree with it.
    """
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
    return ScorerState(
        kind=scorer_json["kind"],
        params=params,
        arrays=arrays,
        files={n: data[n] for n in file_names},
    )


def _stored_scorer(manifest: Mapping[str, Any], data: Mapping[str, bytes], limit: int) -> Scorer:
    """The fitted scorer rebuilt from its stored state (the manifest names the same kind).

    Raises:
        ArtifactSchemaError: the kinds differ, or the scorer cannot be rebuilt.
    """
    state = _stored_state(data, limit)
    manifest_kind = (manifest.get("scorer") or {}).get("kind")
    if manifest_kind != state.kind:
        raise ArtifactSchemaError(
            f"Manifest scorer kind {manifest_kind!r} differs from {SCORER_JSON} kind "
            f"{state.kind!r}."
        )
    try:
        return scorer_from_state(state)
    except AbstainGuardError:
        raise
    except Exception as exc:
        raise ArtifactSchemaError(
            f"Could not rebuild the {state.kind!r} scorer from the artifact: {exc}"
        ) from exc
