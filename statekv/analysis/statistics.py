"""The attention-structure statistics of the paper's appendix A, as pure functions of one step's scores.

Every function takes the scores of one step of a full-attention stream at one layer:

* ``scores`` float ``[G, N]``: the attention mass each of the ``N`` tokens streamed so far received from
  the step's queries, summed over those queries and over heads. ``G`` rows are analysed independently: one
  row (the layer-level score ``s_{n,j}``, summed over every head, as the appendix defines it) or one row
  per KV head.
* ``lengths``: token count of every step so far, the current one last (``sum(lengths) == N``). The current
  step's tokens are the last ``lengths[-1]`` columns; the columns before them are the *history*.

Statistics are returned per row (``[G, ...]``) as float64, so a caller averages them over rows, steps,
layers and videos as it sees fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def split_history(scores: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
    """The history's columns ``[G, N - lengths[-1]]`` (a view)."""
    _check(scores, lengths)
    return scores[:, : scores.shape[1] - lengths[-1]]


def top_mass(history: torch.Tensor) -> torch.Tensor:
    """Cumulative mass of the history sorted in decreasing order, float64 ``[G, H]``.

    ``top_mass(h)[:, k - 1]`` is the mass of the top-``k`` historical tokens; the last column is the total.
    """
    return history.double().sort(dim=-1, descending=True).values.cumsum(dim=-1)


def concentration(cumulative: torch.Tensor, budgets: list[int]) -> torch.Tensor:
    """``C(B)``: share of the historical mass on the top-``B`` historical tokens, ``[G, len(budgets)]``.

    ``cumulative`` is :func:`top_mass` of a non-empty history; budgets beyond the history take all of it (1).
    """
    size = cumulative.shape[1]
    columns = torch.tensor([min(b, size) - 1 for b in budgets], device=cumulative.device)
    return cumulative[:, columns] / cumulative[:, -1:]


def recency_comparison(history: torch.Tensor, cumulative: torch.Tensor, lengths: tuple[int, ...],
                       windows: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Historical mass kept by the ``R`` most recent steps vs by the top tokens at the same budget.

    Returns ``(recent [G, len(windows)], selected [G, len(windows)], tokens)``: the shares of historical mass
    on the last ``R`` historical steps and on the top-``tokens[i]`` historical tokens, where ``tokens[i]`` is
    the number of tokens in those ``R`` steps (the whole history when ``R`` reaches past its start).
    """
    past = lengths[:-1]
    tokens = [sum(past[-r:]) for r in windows]
    total = cumulative[:, -1]
    size = history.shape[1]
    recent = torch.stack([history[:, size - t :].double().sum(dim=-1) for t in tokens], dim=-1)
    selected = cumulative[:, [t - 1 for t in tokens]]
    return recent / total[:, None], selected / total[:, None], tokens


def distance_profile(history: torch.Tensor, lengths: tuple[int, ...], max_distance: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the historical mass lands by step distance.

    Returns ``(share [G, max_distance + 1], present [max_distance + 1] bool)``: column ``d - 1`` holds the
    share of historical mass on the step ``d`` steps back (1 = the previous step) for ``d <= max_distance``,
    the last column everything further back; ``present`` says which columns this step has at all.
    """
    past = lengths[:-1]
    n = len(past)
    ends = torch.tensor(past, device=history.device).cumsum(0)
    per_step = _segment_sums(history.double(), ends)                         # [G, n], oldest first
    share = per_step / per_step.sum(dim=-1, keepdim=True)
    out = torch.zeros(history.shape[0], max_distance + 1, dtype=torch.float64, device=history.device)
    near = min(n, max_distance)
    out[:, :near] = share.flip(-1)[:, :near]
    if n > max_distance:
        out[:, max_distance] = share[:, : n - max_distance].sum(dim=-1)
    present = torch.zeros(max_distance + 1, dtype=torch.bool)
    present[:near] = True
    present[max_distance] = n > max_distance
    return out, present


def _segment_sums(values: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Sums of ``values [G, N]`` over consecutive column segments ending (exclusive) at ``ends [S]``."""
    cumulative = torch.nn.functional.pad(values.cumsum(dim=-1), (1, 0))
    at_ends = cumulative[:, ends]
    return at_ends - torch.nn.functional.pad(at_ends, (1, 0))[:, :-1]


def oracle_order(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices ``[G, min(keep, N)]`` of the highest-scored tokens, best first.

    The oracle state of budget ``B <= keep`` is its first ``B`` columns (top-B sets are nested prefixes of
    one ranking), so one ranking serves every budget.
    """
    return scores.topk(min(keep, scores.shape[1]), dim=-1, sorted=True).indices


@dataclass
class Transition:
    """How the oracle state moved from one step to the next, per row and budget (each ``[G, len(budgets)]``).

    recall: share of the next oracle state inside the candidate pool (previous oracle state ∪ this step).
    weighted_recall: the same, weighted by this step's scores of the next oracle state's tokens.
    retention: share of the previous oracle state still in the next one.
    churn: share of the next oracle state that was not in the previous one.
    """

    recall: torch.Tensor
    weighted_recall: torch.Tensor
    retention: torch.Tensor
    churn: torch.Tensor


def oracle_transition(scores: torch.Tensor, lengths: tuple[int, ...], previous: torch.Tensor,
                      current: torch.Tensor, budgets: list[int]) -> Transition:
    """Compare the oracle state after the previous step with the one after this step.

    Args:
        scores: this step's ``[G, N]``.
        previous: :func:`oracle_order` of the previous step's scores (indices below ``N - lengths[-1]``).
        current: :func:`oracle_order` of ``scores``.
    """
    _check(scores, lengths)
    g, n = scores.shape
    history = n - lengths[-1]
    # Rank of every token in the previous ranking (unranked: beyond any budget): token j is in the previous
    # oracle state of budget B exactly when its rank is below B.
    rank = torch.full((g, n), torch.iinfo(torch.long).max, dtype=torch.long, device=scores.device)
    rank.scatter_(1, previous, torch.arange(previous.shape[1], device=scores.device).expand(g, -1))
    current_rank_before = rank.gather(1, current)                                  # [G, K]
    in_step = current >= history
    weights = scores.gather(1, current).double()
    columns = {name: [] for name in ("recall", "weighted_recall", "retention", "churn")}
    for budget in budgets:
        size, previous_size = min(budget, current.shape[1]), min(budget, previous.shape[1])
        kept = current_rank_before[:, :size] < budget                              # in both oracle states
        pooled = (kept | in_step[:, :size]).double()
        w = weights[:, :size]
        columns["recall"].append(pooled.mean(dim=-1))
        columns["weighted_recall"].append((w * pooled).sum(dim=-1) / w.sum(dim=-1))
        columns["retention"].append(kept.double().sum(dim=-1) / previous_size)
        columns["churn"].append(1.0 - kept.double().mean(dim=-1))
    return Transition(**{name: torch.stack(values, dim=-1) for name, values in columns.items()})


def _check(scores: torch.Tensor, lengths: tuple[int, ...]) -> None:
    if scores.dim() != 2 or sum(lengths) != scores.shape[1] or not lengths or min(lengths) <= 0:
        raise ValueError(f"scores [G, N] must cover the steps' tokens exactly: shape {tuple(scores.shape)}, "
                         f"step lengths {lengths}")
