"""`GuardArtifact`: what calibration produces and the guard loads.

An artifact holds the fitted scorer's state, the calibration scores and labels (so a new
target in the config re-thresholds instantly, with no model run), the model fingerprint
and free JSON metadata. On disk it is a directory::

    manifest.json      schema_version, created, model_fingerprint, scorer kind,
                       sha256 checksums and sizes of every other file, metadata,
                       and manifest_sha256 (a checksum of the manifest itself)
    calibration.npz    scores [n] float64, correct [n] bool   (allow_pickle=False)
    scorer.json        ScorerState kind, params, names of its arrays and files
    scorer.npz         ScorerState arrays                      (allow_pickle=False)
    <raw files>        ScorerState files, e.g. calibrator.ubj (XGBoost)

Loading never executes code: JSON, numpy arrays without pickle, and raw bytes handed to
the scorer's ``from_state``. A missing file raises ArtifactNotFoundError, a changed or
truncated file ArtifactIntegrityError, an unknown schema or malformed content
ArtifactSchemaError, another model's artifact ArtifactMismatchError.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from abstain_guard._version import __version__
from abstain_guard.config import GuardConfig
from abstain_guard.decision import DecisionRule, decision_rule
from abstain_guard.errors import (
    AbstainGuardError,
    ArtifactError,
    ArtifactIntegrityError,
    ArtifactMismatchError,
    ArtifactNotFoundError,
    ArtifactSchemaError,
    InsufficientDataError,
    InvalidInputError,
)
from abstain_guard.scoring import Scorer, ScorerState, scorer_from_state
from abstain_guard.validation import check_labels, check_scores

__all__ = ["SCHEMA_VERSION", "GuardArtifact"]

logger = logging.getLogger("abstain_guard")

SCHEMA_VERSION = 1
FORMAT_NAME = "abstain_guard.artifact"
MANIFEST = "manifest.json"
CALIBRATION = "calibration.npz"
SCORER_JSON = "scorer.json"
SCORER_NPZ = "scorer.npz"
_RESERVED = {MANIFEST, CALIBRATION, SCORER_JSON, SCORER_NPZ}
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


# --- helpers -----------------------------------------------------------------------------


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    for name, arr in arrays.items():
        if np.asarray(arr).dtype.hasobject:
            raise InvalidInputError(
                f"Array {name!r} has dtype object, which cannot be stored without pickle. "
                "Convert it to a numeric or fixed-width string array."
            )
    buf = io.BytesIO()
    np.savez(buf, **{k: np.asarray(v) for k, v in arrays.items()})  # type: ignore[arg-type]
    return buf.getvalue()


def _load_npz(data: bytes, name: str) -> dict[str, np.ndarray]:
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except Exception as exc:  # ValueError (pickled objects), zipfile errors, ...
        raise ArtifactSchemaError(
            f"{name} is not a plain numpy archive ({exc}). Artifacts never contain pickled "
            "objects; re-create the artifact with abstain_guard."
        ) from exc


def _validate_calibration(scores: ArrayLike, correct: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    s = check_scores(scores)
    c = check_labels(correct, s.size).astype(bool)
    return s, c


def _check_json(obj: Any, what: str) -> None:
    try:
        _canonical(obj)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(
            f"{what} must be JSON-serializable (plain dicts, lists, strings, finite numbers): {exc}"
        ) from exc


# --- the artifact --------------------------------------------------------------------------


class GuardArtifact:
    """A fitted scorer plus its calibration scores and labels.

    Build one with :meth:`from_calibration`, write it with :meth:`save`, read it with
    :meth:`load`, and ask it for the threshold of any target with :meth:`decision_rule`.

    Attributes:
        scorer: the fitted :class:`~abstain_guard.scoring.Scorer`.
        scores: calibration scores, shape ``[n]`` (float64).
        correct: calibration labels, shape ``[n]`` (bool).
        model_fingerprint: identity of the model the scores came from (or None).
        metadata: free JSON dict (judge identity, data set, split sizes, ...).
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
    ) -> None:
        if not isinstance(scorer, Scorer):
            raise InvalidInputError(
                f"scorer must be an abstain_guard Scorer, got {type(scorer).__name__}."
            )
        self.scorer = scorer
        self.scores, self.correct = _validate_calibration(scores, correct)
        self.scores.setflags(write=False)
        self.correct.setflags(write=False)
        if model_fingerprint is not None and not isinstance(model_fingerprint, str):
            raise InvalidInputError("model_fingerprint must be a string or None.")
        self.model_fingerprint = model_fingerprint
        meta = dict(metadata or {})
        _check_json(meta, "metadata")
        self.metadata: dict[str, Any] = meta
        self.created = created or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        self.schema_version = SCHEMA_VERSION
        self.path: Path | None = None
        self._rules: dict[tuple[Any, ...], DecisionRule] = {}

    @classmethod
    def from_calibration(
        cls,
        *,
        scorer: Scorer,
        scores: ArrayLike,
        correct: ArrayLike,
        model_fingerprint: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> GuardArtifact:
        """Create an artifact from a fitted scorer and its calibration scores and labels.

        Args:
            scorer: the fitted scorer that produced ``scores``.
            scores: calibration uncertainty scores, shape ``[n]``, finite.
            correct: calibration labels (0/1 or bool), shape ``[n]``.
            model_fingerprint: identity of the chat model (checked by the guard).
            metadata: free JSON metadata stored in the manifest.
        """
        return cls(scorer, scores, correct, model_fingerprint=model_fingerprint, metadata=metadata)

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
        """
        cfg = config if config is not None else GuardConfig()
        if cfg.scorer is not None and cfg.scorer != self.scorer.kind:
            raise ArtifactMismatchError(
                f"The config asks for scorer {cfg.scorer!r} but this artifact was calibrated "
                f"with {self.scorer.kind!r}. Use an artifact for {cfg.scorer!r} or drop the "
                "scorer setting."
            )
        key = (cfg.mode, cfg.participation, cfg.risk_target, cfg.delta, cfg.on_infeasible)
        rule = self._rules.get(key)
        if rule is None:
            rule = decision_rule(self.scores, self.correct, cfg)
            self._rules[key] = rule
        return rule

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
            if not _SAFE_NAME.match(name) or name in _RESERVED:
                raise InvalidInputError(
                    f"Scorer file name {name!r} is not allowed (use letters, digits, '.', '_', "
                    f"'-', not one of {sorted(_RESERVED)})."
                )
        _check_json(state.params, "ScorerState.params")
        scorer_json = {
            "kind": state.kind,
            "params": state.params,
            "arrays": sorted(state.arrays),
            "files": sorted(state.files),
        }
        files: dict[str, bytes] = {
            CALIBRATION: _npz_bytes({"scores": self.scores, "correct": self.correct}),
            SCORER_JSON: json.dumps(scorer_json, indent=2, sort_keys=True).encode(),
            SCORER_NPZ: _npz_bytes(state.arrays),
        }
        for name, data in state.files.items():
            files[name] = bytes(data)
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
            "checksums": {name: _sha256(data) for name, data in sorted(files.items())},
            "sizes": {name: len(data) for name, data in sorted(files.items())},
            "metadata": self.metadata,
        }
        manifest["manifest_sha256"] = _sha256(_canonical(manifest))
        return manifest

    def save(self, path: str | os.PathLike[str], overwrite: bool = False) -> Path:
        """Write the artifact directory (atomically: a temporary directory is renamed).

        Args:
            path: the directory to create.
            overwrite: replace an existing artifact directory at ``path``. A non-empty
                directory that is not an artifact is never replaced.

        Returns:
            The directory path.
        """
        target = Path(path)
        if target.exists():
            if not target.is_dir():
                raise ArtifactError(f"{str(target)!r} exists and is not a directory.")
            if any(target.iterdir()):
                if not overwrite:
                    raise ArtifactError(
                        f"{str(target)!r} already exists; pass overwrite=True to replace it."
                    )
                if not (target / MANIFEST).is_file():
                    raise ArtifactError(
                        f"{str(target)!r} is a non-empty directory without {MANIFEST}; refusing "
                        "to replace something that is not an artifact."
                    )
        files = self._files()
        manifest = self._manifest(files)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            for name, data in files.items():
                (tmp / name).write_bytes(data)
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            if target.exists():
                old = target.with_name(f".{target.name}.old-{os.getpid()}")
                target.rename(old)
                tmp.rename(target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.path = target
        return target

    # --- load --------------------------------------------------------------------------

    @classmethod
    def read_manifest(cls, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Read and verify ``manifest.json`` (schema and self-checksum) without loading data."""
        root = Path(path)
        if not root.is_dir():
            raise ArtifactNotFoundError(
                f"No artifact directory at {str(root)!r}. Run calibration first (abstain-guard "
                "calibrate) or pass the directory GuardArtifact.save wrote."
            )
        mpath = root / MANIFEST
        if not mpath.is_file():
            raise ArtifactNotFoundError(
                f"{str(root)!r} has no {MANIFEST}: it is not an artifact, or it is incomplete."
            )
        raw = mpath.read_bytes()
        try:
            manifest = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ArtifactIntegrityError(
                f"{MANIFEST} in {str(root)!r} is not valid JSON ({exc}): the artifact is "
                "corrupted or truncated. Re-create or re-copy it."
            ) from exc
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
            raise ArtifactSchemaError(
                f"{MANIFEST} in {str(root)!r} is not an abstain_guard artifact manifest."
            )
        version = manifest.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ArtifactSchemaError(
                f"Artifact schema version {version!r} is not supported (this abstain_guard reads "
                f"version {SCHEMA_VERSION}). Upgrade abstain_guard or re-create the artifact."
            )
        claimed = manifest.pop("manifest_sha256", None)
        try:
            actual = _sha256(_canonical(manifest))
        except (TypeError, ValueError) as exc:
            raise ArtifactSchemaError(f"{MANIFEST} holds non-JSON values: {exc}") from exc
        if claimed != actual:
            raise ArtifactIntegrityError(
                f"{MANIFEST} in {str(root)!r} was modified (its checksum does not match). "
                "Re-create or re-copy the artifact."
            )
        checksums = manifest.get("checksums")
        if not isinstance(checksums, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in checksums.items()
        ):
            raise ArtifactSchemaError(f"{MANIFEST} has no valid 'checksums' mapping.")
        missing_required = sorted({CALIBRATION, SCORER_JSON, SCORER_NPZ} - set(checksums))
        if missing_required:
            raise ArtifactSchemaError(
                f"{MANIFEST} does not list required files {missing_required}."
            )
        for name in checksums:
            if not _SAFE_NAME.match(name) or name == MANIFEST:
                raise ArtifactSchemaError(f"{MANIFEST} lists an invalid file name {name!r}.")
        return manifest

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], expected_fingerprint: str | None = None
    ) -> GuardArtifact:
        """Load and verify an artifact directory.

        Args:
            path: the directory written by :meth:`save`.
            expected_fingerprint: when given (and the artifact has a fingerprint), they
                must be equal.

        Raises:
            ArtifactNotFoundError: the directory or a file is missing.
            ArtifactIntegrityError: a file's checksum or size does not match the manifest.
            ArtifactSchemaError: unsupported schema version or malformed content.
            ArtifactMismatchError: the artifact belongs to another model.
        """
        root = Path(path)
        manifest = cls.read_manifest(root)
        data: dict[str, bytes] = {}
        for name, digest in sorted(manifest["checksums"].items()):
            fpath = root / name
            if not fpath.is_file():
                raise ArtifactNotFoundError(
                    f"Artifact file {name!r} is missing from {str(root)!r}. Re-copy the whole "
                    "artifact directory."
                )
            blob = fpath.read_bytes()
            if _sha256(blob) != digest:
                raise ArtifactIntegrityError(
                    f"Artifact file {name!r} in {str(root)!r} does not match its checksum (it "
                    "was modified or truncated). Re-create or re-copy the artifact."
                )
            data[name] = blob

        fingerprint = manifest.get("model_fingerprint")
        if fingerprint is not None and not isinstance(fingerprint, str):
            raise ArtifactSchemaError("manifest model_fingerprint must be a string or null.")

        calib = _load_npz(data[CALIBRATION], CALIBRATION)
        if set(calib) != {"scores", "correct"}:
            raise ArtifactSchemaError(
                f"{CALIBRATION} must hold exactly 'scores' and 'correct', has {sorted(calib)}."
            )
        try:
            scorer_json = json.loads(data[SCORER_JSON].decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ArtifactSchemaError(f"{SCORER_JSON} is not valid JSON: {exc}") from exc
        if not isinstance(scorer_json, dict) or not isinstance(scorer_json.get("kind"), str):
            raise ArtifactSchemaError(f"{SCORER_JSON} must be an object with a string 'kind'.")
        arrays = _load_npz(data[SCORER_NPZ], SCORER_NPZ)
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
            artifact = cls(
                scorer,
                calib["scores"],
                calib["correct"],
                model_fingerprint=fingerprint,
                metadata=metadata,
                created=manifest.get("created"),
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
