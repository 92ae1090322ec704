"""The paper's hypothesis checks (Figure 8) on the answers' geometry, and the layout of a
permutation-importance result (Figure 9); the tests: docs/results.md, 'The paper's
hypothesis checks'. Pure numpy/scipy on already computed geometry; no model runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy import stats

from abstain_guard.errors import InsufficientDataError, InvalidInputError
from abstain_guard.guarantee.validation import check_labels

IMPORTANCE_FAMILIES: tuple[str, ...] = ("omega", "theta", "phi_in", "phi_out")
"""The geometry signals permuted by the importance ablation, in the order the report shows."""
IMPORTANCE_KEYS: tuple[str, ...] = (
    "auroc_drop_mean",
    "auroc_drop_sd",
    "auprc_drop_mean",
    "auprc_drop_sd",
)


def _geometry_array(geom: Mapping[str, Any], key: str, i: int, width: int) -> NDArray[np.float64]:
    try:
        a = np.asarray(geom[key], dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"geometry {i}: {key!r} is not numeric ({exc}).") from exc
    if a.size == 0:
        return a.reshape(0, width)
    if a.ndim != 2 or a.shape[1] != width:
        raise InvalidInputError(
            f"geometry {i}: {key!r} has shape {a.shape}; expected [tokens, 2L-1] = "
            f"[N, {width}] for num_layers L = {(width + 1) // 2}."
        )
    return a


def _per_response_features(
    geometries: Sequence[Mapping[str, Any] | None],
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.bool_], NDArray[np.bool_], int]:
    """Token-averaged ``Ω⊙Θ`` and ``Φ^in−Φ^out`` per response: ``[n, 2L−1]`` each (NaN rows
    where a response has no geometry, no tokens or no Φ), the masks of usable rows, and ``L``."""
    if len(geometries) == 0:
        raise InsufficientDataError("no geometries given; pass one geometry dict per response.")
    num_layers: int | None = None
    ot_rows: list[NDArray[np.float64]] = []
    phi_rows: list[NDArray[np.float64]] = []
    ot_ok: list[bool] = []
    phi_ok: list[bool] = []
    missing: list[int] = []
    for i, geom in enumerate(geometries):
        if geom is None:  # the response carries no geometry (capture off or failed)
            missing.append(i)
            continue
        if not isinstance(geom, Mapping) or "omega" not in geom or "theta" not in geom:
            raise InvalidInputError(
                f"geometry {i} is not a geometry dict with 'num_layers', 'omega', 'theta' "
                "(response_metadata['geometry'] of a GeometryChatModel answer)."
            )
        n_layers = int(geom.get("num_layers") or 0)
        if n_layers < 1:
            raise InvalidInputError(f"geometry {i}: num_layers must be a positive integer.")
        if num_layers is None:
            num_layers = n_layers
        elif n_layers != num_layers:
            raise InvalidInputError(
                f"geometry {i} has num_layers={n_layers} but earlier ones {num_layers}; "
                "hypothesis checks need responses of one model."
            )
        width = 2 * n_layers - 1
        omega = _geometry_array(geom, "omega", i, width)
        theta = _geometry_array(geom, "theta", i, width)
        if omega.shape != theta.shape:
            raise InvalidInputError(
                f"geometry {i}: omega {omega.shape} and theta {theta.shape} differ in shape."
            )
        usable = omega.shape[0] > 0
        ot_rows.append((omega * theta).mean(axis=0) if usable else np.full(width, np.nan))
        ot_ok.append(usable)
        if geom.get("phi_in") is not None and geom.get("phi_out") is not None and usable:
            phi_in = _geometry_array(geom, "phi_in", i, width)
            phi_out = _geometry_array(geom, "phi_out", i, width)
            if phi_in.shape != omega.shape or phi_out.shape != omega.shape:
                raise InvalidInputError(
                    f"geometry {i}: phi_in {phi_in.shape} / phi_out {phi_out.shape} must match "
                    f"omega {omega.shape}."
                )
            phi_rows.append((phi_in - phi_out).mean(axis=0))
            phi_ok.append(True)
        else:
            phi_rows.append(np.full(width, np.nan))
            phi_ok.append(False)
    if num_layers is None:
        raise InsufficientDataError(
            "no response carries geometry (all entries are None); generate with a "
            "GeometryChatModel to run the hypothesis checks."
        )
    width = 2 * num_layers - 1
    for i in missing:  # restore the input order with empty rows for missing geometry
        ot_rows.insert(i, np.full(width, np.nan))
        phi_rows.insert(i, np.full(width, np.nan))
        ot_ok.insert(i, False)
        phi_ok.insert(i, False)
    return (
        np.vstack(ot_rows),
        np.vstack(phi_rows),
        np.array(ot_ok),
        np.array(phi_ok),
        num_layers,
    )


def _compare(
    values: NDArray[np.float64],
    y: NDArray[np.int64],
    expected: Literal["greater", "less"],
    significance: float,
) -> dict[str, Any]:
    """Correct-vs-incorrect comparison of per-response features ``values [n, 2L−1]``."""
    corr, inc = values[y == 1], values[y == 0]
    if corr.shape[0] == 0 or inc.shape[0] == 0:
        raise InsufficientDataError(
            f"hypothesis checks need correct and incorrect responses; got {corr.shape[0]} "
            f"correct and {inc.shape[0]} incorrect with usable geometry."
        )
    n_c, n_i = corr.shape[0], inc.shape[0]

    def sem(a: NDArray[np.float64]) -> NDArray[np.float64]:
        if a.shape[0] < 2:
            return np.zeros(a.shape[1])
        return np.asarray(a.std(axis=0, ddof=1) / math.sqrt(a.shape[0]), dtype=np.float64)

    per_layer_p = np.asarray(
        stats.mannwhitneyu(corr, inc, axis=0, alternative="two-sided").pvalue, dtype=np.float64
    )
    per_layer_p = np.where(np.isnan(per_layer_p), 1.0, per_layer_p)
    q = stats.false_discovery_control(per_layer_p, method="bh")
    diff = corr.mean(axis=0) - inc.mean(axis=0)
    agrees = diff > 0 if expected == "greater" else diff < 0

    # The paper's per-sample aggregate: average over the 2L−1 interleaved layers.
    agg_c, agg_i = corr.mean(axis=1), inc.mean(axis=1)
    test = stats.mannwhitneyu(agg_c, agg_i, alternative="two-sided")
    prob_greater = float(test.statistic / (n_c * n_i))  # P(correct > incorrect) + ties/2
    direction_ok = bool(
        agg_c.mean() > agg_i.mean() if expected == "greater" else agg_c.mean() < agg_i.mean()
    )
    return {
        "expected_direction": f"correct {expected} than incorrect",
        "n_correct": int(n_c),
        "n_incorrect": int(n_i),
        "per_layer": {
            "mean_correct": corr.mean(axis=0).tolist(),
            "mean_incorrect": inc.mean(axis=0).tolist(),
            "sem_correct": sem(corr).tolist(),
            "sem_incorrect": sem(inc).tolist(),
            "p_value": per_layer_p.tolist(),
            "q_value_bh": np.asarray(q, dtype=np.float64).tolist(),
        },
        "n_layers_significant": int((q < significance).sum()),
        "n_layers_significant_expected_direction": int(((q < significance) & agrees).sum()),
        "n_layer_indices": int(values.shape[1]),
        "aggregate": {
            "values_correct": agg_c.tolist(),
            "values_incorrect": agg_i.tolist(),
            "mean_correct": float(agg_c.mean()),
            "mean_incorrect": float(agg_i.mean()),
            "median_correct": float(np.median(agg_c)),
            "median_incorrect": float(np.median(agg_i)),
            "mann_whitney_p": float(test.pvalue),
            "prob_correct_greater": prob_greater,
        },
        "supported": bool(direction_ok and float(test.pvalue) < significance),
    }


def hypothesis_checks(
    geometries: Sequence[Mapping[str, Any] | None],
    correct: ArrayLike,
    significance: float = 0.05,
) -> dict[str, Any]:
    """The paper's hypothesis validation (Figure 8) on one ``response_metadata["geometry"]``
    dict per response (``None`` for a response without geometry: left out, counted in
    ``n_without_tokens``) and 0/1 labels ``correct [n]``: ``{"num_layers", "n",
    "n_without_tokens", "knowledge_interaction": {...}, "relative_angular_distance": {...} |
    None, "n_without_phi"}``, the second ``None`` when no response carries Φ (reference
    means not fitted). What is compared: docs/results.md, 'The paper's hypothesis checks'.

    Raises:
        InvalidInputError: malformed geometry dicts, length mismatch.
        InsufficientDataError: no correct or no incorrect response with tokens.
    """
    y = check_labels(correct)
    if len(geometries) != y.size:
        raise InvalidInputError(
            f"length mismatch: {len(geometries)} geometries but {y.size} labels."
        )
    ot, phi, ot_ok, phi_ok, num_layers = _per_response_features(geometries)
    result: dict[str, Any] = {
        "num_layers": num_layers,
        "n": int(y.size),
        "n_without_tokens": int((~ot_ok).sum()),
        "n_without_phi": int((~phi_ok).sum()),
        "significance": significance,
        "knowledge_interaction": _compare(ot[ot_ok], y[ot_ok], "greater", significance),
        "relative_angular_distance": None,
    }
    if phi_ok.any():
        result["relative_angular_distance"] = _compare(phi[phi_ok], y[phi_ok], "less", significance)
    return result


def validate_importance(importance: Any) -> dict[str, Any]:
    """Check a permutation-importance result and return it as family → ``{"auroc_drop_mean",
    "auroc_drop_sd", "auprc_drop_mean", "auprc_drop_sd"}`` of plain floats.

    Accepted forms:

    * family → ``{"auroc_drop_mean", "auroc_drop_sd", "auprc_drop_mean", "auprc_drop_sd"}``
      (other keys are kept);
    * ``GeometryScorer.feature_importance(...)`` itself or its ``to_dict()``:
      ``{"auroc", "auprc", "drops": {family: {"auroc_mean", "auroc_sd", "auprc_mean",
      "auprc_sd"}}}`` — the unpermuted ``auroc``/``auprc`` are kept in every family's entry as
      ``unpermuted_auroc`` / ``unpermuted_auprc``.
    """
    if hasattr(importance, "to_dict") and callable(importance.to_dict):
        importance = importance.to_dict()
    hint = (
        "importance must be family → {auroc_drop_mean, auroc_drop_sd, auprc_drop_mean, "
        "auprc_drop_sd}, or GeometryScorer.feature_importance(...) / its to_dict()."
    )
    if not isinstance(importance, Mapping) or not importance:
        raise InvalidInputError(hint)
    extra: dict[str, float] = {}
    if isinstance(importance.get("drops"), Mapping):
        for key in ("auroc", "auprc"):
            if isinstance(importance.get(key), (int, float, np.integer, np.floating)):
                extra[f"unpermuted_{key}"] = float(importance[key])
        renamed: dict[str, dict[str, Any]] = {}
        for family, entry in importance["drops"].items():
            if not isinstance(entry, Mapping):
                raise InvalidInputError(f"importance drops[{family!r}] must be a dict. {hint}")
            renamed[family] = {
                (
                    f"{k[:5]}_drop_{k[6:]}"
                    if k in ("auroc_mean", "auroc_sd", "auprc_mean", "auprc_sd")
                    else k
                ): v
                for k, v in entry.items()
            }
        importance = renamed
    out: dict[str, Any] = {}
    for family, entry in importance.items():
        if not isinstance(entry, Mapping):
            raise InvalidInputError(f"importance[{family!r}] must be a dict of numbers. {hint}")
        missing = [k for k in IMPORTANCE_KEYS if k not in entry]
        if missing:
            raise InvalidInputError(
                f"importance[{family!r}] lacks {missing}; expected keys {list(IMPORTANCE_KEYS)}."
            )
        clean: dict[str, Any] = {}
        for k, v in entry.items():
            clean[k] = float(v) if isinstance(v, (int, float, np.integer, np.floating)) else v
        clean.update(extra)
        out[str(family)] = clean
    if not out:
        raise InvalidInputError(f"importance has no feature families. {hint}")
    return out
