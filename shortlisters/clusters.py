"""Vocabulary clusters for the DynaSpec shortlister: spherical k-means on the LM-head rows.

Each token's LM-head row is normalised to unit length and the rows are clustered by cosine
similarity (spherical k-means: assign by the largest dot product with the unit centroids, update
each centroid to the normalised mean of its rows). Initialisation is k-means++ (on the cosine
distance) with a fixed seed; a cluster left empty is repaired by moving to it the row worst served
by its current centroid. A torch implementation is used: it is a few matrix products per
iteration, which scikit-learn's Euclidean KMeans would not make cheaper at this size.

Artifact ``clusters.safetensors``: ``assignment`` [V] (cluster of each token), ``order`` [V] (token
ids sorted by cluster: the head layout), ``offsets`` [M+1] (cluster m is ``order[offsets[m]:offsets[m+1]]``),
``centroids`` [M, d]; metadata records the target fingerprint and the command.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from dynaspec.errors import ConfigError
from dynaspec.runtime.artifacts import read_artifact, write_artifact

FORMAT = "dynaspec-clusters/1"
FILE = "clusters.safetensors"


def _kmeans_pp(x: torch.Tensor, m: int, gen: torch.Generator, chunk: int) -> torch.Tensor:
    """k-means++ seeding on unit rows with distance 1 - cos."""
    n = x.shape[0]
    centers = torch.empty(m, x.shape[1], dtype=x.dtype)
    first = int(torch.randint(n, (1,), generator=gen))
    centers[0] = x[first]
    dist = (1.0 - x @ centers[0]).clamp_(min=0)
    for k in range(1, m):
        probs = dist / dist.sum() if float(dist.sum()) > 0 else torch.full_like(dist, 1.0 / n)
        pick = int(torch.multinomial(probs, 1, generator=gen))
        centers[k] = x[pick]
        dist = torch.minimum(dist, (1.0 - x @ centers[k]).clamp_(min=0))
    return centers


def _assign(x: torch.Tensor, centers: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.empty(x.shape[0], dtype=torch.long)
    best = torch.empty(x.shape[0], dtype=x.dtype)
    for s in range(0, x.shape[0], chunk):
        sims = x[s:s + chunk] @ centers.T
        best[s:s + chunk], labels[s:s + chunk] = sims.max(dim=1)
    return labels, best


def spherical_kmeans(weight: torch.Tensor, m: int, *, iterations: int = 25, seed: int = 0,
                     chunk: int = 16384, progress: bool = True, tol: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Cluster the rows of ``weight`` [V, d] into ``m`` groups; returns (assignment, centroids, log)."""
    from tqdm import tqdm

    if not 1 <= m <= weight.shape[0]:
        raise ConfigError(f"clusters = {m} is invalid: must be between 1 and the vocabulary size {weight.shape[0]}")
    x = torch.nn.functional.normalize(weight.detach().float(), dim=1)
    gen = torch.Generator().manual_seed(seed)
    # seeding on a subsample keeps k-means++ cheap at 262k rows; the iterations use every row
    sample = x[torch.randperm(x.shape[0], generator=gen)[: min(x.shape[0], 64 * m)]]
    centers = _kmeans_pp(sample, m, gen, chunk)
    history = []
    bar = tqdm(range(iterations), desc=f"k-means M={m}", unit="it", file=sys.stderr, disable=not progress)
    labels = None
    for _ in bar:
        new_labels, best = _assign(x, centers, chunk)
        sums = torch.zeros_like(centers).index_add_(0, new_labels, x)
        counts = torch.bincount(new_labels, minlength=m)
        for empty in (counts == 0).nonzero().flatten().tolist():
            # repair: the row worst served by its centroid founds the empty cluster
            worst = int(best.argmin())
            old = int(new_labels[worst])
            sums[old] -= x[worst]
            counts[old] -= 1
            new_labels[worst] = empty
            sums[empty] = x[worst]
            counts[empty] = 1
            best[worst] = float("inf")  # a founder is never moved again in this pass
        centers = torch.nn.functional.normalize(sums, dim=1)
        objective = float(best[torch.isfinite(best)].mean())
        changed = 1.0 if labels is None else float((new_labels != labels).float().mean())
        labels = new_labels
        history.append({"mean_cosine": round(objective, 6), "changed": round(changed, 6)})
        bar.set_postfix(cos=f"{objective:.4f}", changed=f"{changed:.4f}")
        if changed < tol:
            break
    sizes = torch.bincount(labels, minlength=m)
    log = {"iterations": len(history), "history": history, "min_size": int(sizes.min()),
           "max_size": int(sizes.max())}
    return labels, centers, log


def save_clusters(path: str | Path, assignment: torch.Tensor, centroids: torch.Tensor,
                  provenance: dict[str, Any]) -> Path:
    m = centroids.shape[0]
    order = torch.argsort(assignment, stable=True)
    offsets = torch.zeros(m + 1, dtype=torch.int64)
    offsets[1:] = torch.bincount(assignment, minlength=m).cumsum(0)
    return write_artifact(path, FILE, FORMAT, {
        "assignment": assignment.to(torch.int32), "order": order.to(torch.int32), "offsets": offsets,
        "centroids": centroids.to(torch.bfloat16)}, provenance)


def load_clusters(path: str | Path, fingerprint: dict[str, Any] | None) -> dict[str, Any]:
    """The cluster tensors and provenance; refuses clusters built for another target."""
    tensors, provenance, _ = read_artifact(path, FILE, FORMAT, what="cluster file", fingerprint=fingerprint)
    return {**tensors, "provenance": provenance}
