"""Black-box uncertainty of k sampled answers, from their similarities alone (pure numpy).

Every function reads a ``[k, k]`` similarity or equivalence matrix of the k answers sampled
for one question and returns an uncertainty, **higher = more uncertain** (as every scorer of
the library); none needs logprobs or hidden states.

* Semantic sets (Farquhar et al., "Detecting hallucinations in large language models using
  semantic entropy", Nature 2024): the answers are clustered into meaning classes
  (:func:`semantic_ids`, over bidirectional entailment or a similarity threshold,
  :func:`equivalent_by_threshold`); :func:`discrete_semantic_entropy` is the entropy of the
  class frequencies and :func:`number_of_semantic_sets` their count.
* Spectral scores over the similarity graph (Lin, Trivedi & Sun, "Generating with
  Confidence: Uncertainty Quantification for Black-box Large Language Models", 2023): with
  ``W`` the symmetric affinity (:func:`affinity`), ``D`` its degree matrix and
  ``L = I - D^{-1/2} W D^{-1/2}`` the normalized Laplacian (:func:`normalized_laplacian`),
  :func:`eigenvalue_uncertainty` (EigV), :func:`degree_uncertainty` (Deg) and
  :func:`eccentricity_uncertainty` (Ecc); the last two also per answer (``C_Deg``,
  ``C_Ecc`` of the paper, as uncertainties), for scoring one chosen answer.

``weights`` is always the ``[k, k]`` affinity of :func:`affinity`, ``similarity`` a
``[k, k]`` similarity matrix, ``ids`` the ``[k]`` class ids of :func:`semantic_ids`. ``W``
keeps its diagonal (an answer is fully similar to itself, ``W_jj = 1``), as in the paper's
definitions of ``D`` and ``U_Deg``; :func:`scipy.sparse.csgraph.laplacian` drops self-loops,
hence the two lines of :func:`normalized_laplacian`.
"""

from __future__ import annotations

import numpy as np

from abstain_guard.errors import InvalidInputError

ECCENTRICITY_EIGENVALUE_THRESHOLD = 0.9
"""Eigenvectors of ``L`` with eigenvalues below this embed the answers for the eccentricity
(Lin et al.'s released code)."""


def _square(matrix: np.ndarray, name: str) -> np.ndarray:
    m = np.asarray(matrix)
    if m.ndim != 2 or m.shape[0] != m.shape[1] or m.shape[0] == 0:
        raise InvalidInputError(f"{name} must be a non-empty square [k, k] matrix, got {m.shape}.")
    if m.dtype != bool and not np.all(np.isfinite(m)):
        raise InvalidInputError(f"{name} holds NaN or infinite values.")
    return m


def cosine_similarities(embeddings: np.ndarray) -> np.ndarray:
    """Cosine similarity of every pair of answers.

    Args:
        embeddings: ``[k, E]`` answer embeddings (any norm but zero).

    Returns:
        ``[k, k]`` similarities in ``[-1, 1]``, ones on the diagonal.
    """
    emb = np.asarray(embeddings, dtype=np.float64)
    if emb.ndim != 2 or emb.shape[0] == 0:
        raise InvalidInputError(f"embeddings must be [k, E] with k >= 1, got {emb.shape}.")
    norms = np.linalg.norm(emb, axis=1, keepdims=True)
    if np.any(norms == 0) or not np.all(np.isfinite(norms)):
        raise InvalidInputError("Every embedding must be finite and non-zero.")
    unit = emb / norms
    sim = np.clip(unit @ unit.T, -1.0, 1.0)
    np.fill_diagonal(sim, 1.0)
    return sim


def equivalent_by_threshold(similarity: np.ndarray, threshold: float) -> np.ndarray:
    """``[k, k]`` bool: answers ``i`` and ``j`` mean the same when both ``S_ij`` and
    ``S_ji`` reach ``threshold`` (bidirectional, as entailment is asked both ways)."""
    sim = _square(similarity, "similarity").astype(np.float64)
    return np.minimum(sim, sim.T) >= threshold


def semantic_ids(equivalent: np.ndarray) -> np.ndarray:
    """Meaning classes of k answers (Farquhar et al.'s ``get_semantic_ids``): answer ``i``,
    if not yet in a class, opens one, and every later unassigned answer ``j`` equivalent to
    ``i`` joins it. A class is thus compared with its first member only.

    Args:
        equivalent: ``[k, k]`` bool, ``equivalent[i, j]`` when answers i and j mean the same.

    Returns:
        ``[k]`` int class ids, numbered 0, 1, ... in order of first appearance.
    """
    eq = _square(equivalent, "equivalent").astype(bool)
    k = eq.shape[0]
    ids = np.full(k, -1, dtype=np.int64)
    next_id = 0
    for i in range(k):
        if ids[i] >= 0:
            continue
        ids[i] = next_id
        for j in range(i + 1, k):
            if ids[j] < 0 and eq[i, j]:
                ids[j] = next_id
        next_id += 1
    return ids


def _ids(ids: np.ndarray) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise InvalidInputError(f"semantic ids must be a non-empty [k] int array, got {arr!r}.")
    return arr


def discrete_semantic_entropy(ids: np.ndarray) -> float:
    """Entropy (nats) of the meaning classes' frequencies: ``-Σ_c p_c log p_c`` with ``p_c``
    the share of the k answers in class ``c`` (Farquhar et al.'s discrete semantic entropy,
    ``cluster_assignment_entropy``). 0 when all answers agree; ``log k`` when all differ."""
    _, counts = np.unique(_ids(ids), return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum())


def number_of_semantic_sets(ids: np.ndarray) -> int:
    """How many meaning classes the k answers fall into (Lin et al.'s ``NumSets``), 1..k."""
    return int(np.unique(_ids(ids)).size)


def affinity(similarity: np.ndarray) -> np.ndarray:
    """The graph's weights ``W = clip((S + Sᵀ) / 2, 0, 1)`` with ``W_jj = 1``: symmetric and
    non-negative, as the Laplacian needs (a negative cosine is no similarity); ``similarity``
    is a cosine matrix or entailment scores."""
    sim = _square(similarity, "similarity").astype(np.float64)
    w = np.clip((sim + sim.T) / 2.0, 0.0, 1.0)
    np.fill_diagonal(w, 1.0)
    return w


def normalized_laplacian(weights: np.ndarray) -> np.ndarray:
    """``L = I - D^{-1/2} W D^{-1/2}`` with ``D = diag(Σ_j W_ij)``: ``[k, k]`` and symmetric,
    its eigenvalues in ``[0, 2]``."""
    w = _square(weights, "weights").astype(np.float64)
    degree = w.sum(axis=1)
    if np.any(degree <= 0):
        raise InvalidInputError("Every answer needs a positive degree (W_jj = 1 gives it).")
    scale = 1.0 / np.sqrt(degree)
    return np.eye(w.shape[0]) - scale[:, None] * w * scale[None, :]


def eigenvalue_uncertainty(weights: np.ndarray) -> float:
    """EigV: ``Σ_k max(0, 1 - λ_k)`` over the eigenvalues of the normalized Laplacian, a
    continuous count of meaning clusters: 1 when all answers are one (``W`` all ones), k when
    none is like another (``W = I``)."""
    eigenvalues = np.linalg.eigvalsh(normalized_laplacian(weights))
    return float(np.clip(1.0 - eigenvalues, 0.0, None).sum())


def degree_uncertainties(weights: np.ndarray) -> np.ndarray:
    """Per answer ``1 - C_Deg(s_j) = 1 - D_jj / k``: how unlike the other answers answer j is
    (``[k]``, in ``[0, 1 - 1/k]``)."""
    w = _square(weights, "weights").astype(np.float64)
    return 1.0 - w.sum(axis=1) / w.shape[0]


def degree_uncertainty(weights: np.ndarray) -> float:
    """Deg: ``U_Deg = trace(kI - D) / k²``, the mean of :func:`degree_uncertainties`; 0 when
    all answers are one, ``1 - 1/k`` when none is like another."""
    return float(degree_uncertainties(weights).mean())


def eccentricities(
    weights: np.ndarray, eigenvalue_threshold: float = ECCENTRICITY_EIGENVALUE_THRESHOLD
) -> np.ndarray:
    """Per answer ``-C_Ecc(s_j) = ‖v_j - v̄‖₂``: answer j's distance from the centre of the
    spectral embedding, whose coordinates are the eigenvectors of ``L`` with eigenvalues below
    ``eigenvalue_threshold`` (row j = answer j; at least the smallest one is kept); ``[k]``."""
    eigenvalues, vectors = np.linalg.eigh(normalized_laplacian(weights))
    keep = eigenvalues < eigenvalue_threshold
    keep[0] = True
    v = vectors[:, keep]
    return np.linalg.norm(v - v.mean(axis=0, keepdims=True), axis=1)


def eccentricity_uncertainty(
    weights: np.ndarray, eigenvalue_threshold: float = ECCENTRICITY_EIGENVALUE_THRESHOLD
) -> float:
    """Ecc: ``U_Ecc = ‖[‖v_1 - v̄‖, …, ‖v_k - v̄‖]‖₂`` (:func:`eccentricities`); 0 when all
    answers are one, ``sqrt(k - 1)`` when none is like another."""
    return float(np.linalg.norm(eccentricities(weights, eigenvalue_threshold)))


def medoid_index(similarity: np.ndarray) -> int:
    """The answer most similar to all the others (largest row sum of ``S``; the first on a
    tie): the primary answer under the ``"medoid"`` rule."""
    sim = _square(similarity, "similarity").astype(np.float64)
    return int(np.argmax(sim.sum(axis=1)))
