"""Drafts: the answers an evaluation checks in the same forward that reads its prompt.

A standing question's answer mostly stays as it was, and when it changes it mostly changes to an answer it gave
before or to a first token the model ranked just below its answer's. The forward that reads an evaluation's prompt
therefore also reads a :class:`DraftTree` after it: its latest answer, its earlier distinct answers and the
runner-up first tokens of its last evaluation, as one tree of tokens (answers sharing a beginning share its nodes),
each node at the position after its parent and reading only the prompt, its ancestors and itself. One forward then
predicts the token after the prompt and after every node, and the greedy answer is read off by walking the tree
(`DraftTree.walk`): from the prompt, to the child holding each predicted token, while there is one. An answer
found whole in the tree costs that one forward; otherwise decoding goes on from where the walk stopped, one
forward per token. The answer is the greedy one either way: a node only lets its prediction be read earlier.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

EARLIER_ANSWERS = 4  # distinct earlier answers a standing question keeps as drafts
RUNNERS_UP = 3  # first tokens the model ranked after its answer's, kept from the last evaluation
EXTRA_NODES = 3  # nodes the earlier answers and the runners-up may add to a tree beyond the latest answer's


@dataclass
class DraftTree:
    """A tree of draft tokens after a prompt: node ``j`` holds ``tokens[j]`` after node ``parents[j]`` (-1: the
    prompt's last token), ``depths[j]`` tokens into the answer; parents come before their children."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    children: dict[tuple[int, int], int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, answer: Sequence[int], limit: int | None = None) -> None:
        """Add the path of ``answer``'s tokens, while the tree has fewer than ``limit`` nodes (None: no limit)."""
        parent = -1
        for token in answer:
            node = self.children.get((parent, token))
            if node is None:
                if limit is not None and len(self.tokens) >= limit:
                    return
                node = len(self.tokens)
                self.tokens.append(token)
                self.parents.append(parent)
                self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
                self.children[parent, token] = node
            parent = node

    def reads(self) -> np.ndarray:
        """``[n, n]`` bool (numpy, made on the host): node ``j`` reads node ``i`` (``i`` is ``j`` or one of its
        ancestors)."""
        reads = np.zeros((len(self.tokens), len(self.tokens)), dtype=bool)
        for node, parent in enumerate(self.parents):  # a parent's row is made before its children's
            if parent >= 0:
                reads[node] = reads[parent]
            reads[node, node] = True
        return reads

    def walk(self, told: Sequence[int], ends: set[int], longest: int) -> tuple[list[int], list[int]]:
        """The greedy answer read off the tree and the nodes on its path. ``told``: the token predicted after the
        prompt, then after each node. The answer stops after an end token, at ``longest`` tokens, or after the
        first token no node holds (decoding goes on from there)."""
        answer, path, node = [], [], -1
        while True:
            token = told[node + 1]
            answer.append(token)
            if token in ends or len(answer) >= longest:
                return answer, path
            node = self.children.get((node, token), -1)
            if node < 0:
                return answer, path
            path.append(node)


def draft_tree(latest: Sequence[int], earlier: Iterable[Sequence[int]], runners_up: Iterable[int],
               ends: set[int], longest: int) -> DraftTree:
    """The drafts an evaluation answering at most ``longest`` tokens checks: the ``latest`` answer whole, then the
    ``earlier`` answers and the ``runners_up`` first tokens while they add at most `EXTRA_NODES` nodes. A draft's
    tokens from its first end token on are left out, as are those past ``longest - 1`` (what the model predicts
    after them is never read)."""
    tree = DraftTree()
    tree.add(_cut(latest, ends, longest))
    limit = len(tree) + EXTRA_NODES
    for answer in earlier:
        tree.add(_cut(answer, ends, longest), limit)
    for token in runners_up:
        tree.add(_cut([token], ends, longest), limit)
    return tree


def _cut(answer: Sequence[int], ends: set[int], longest: int) -> list[int]:
    kept = []
    for token in list(answer)[: max(longest - 1, 0)]:
        if token in ends:
            break
        kept.append(token)
    return kept


def kept_answers(answers: Sequence, tokens: Sequence[list[int]], answer: list[int]) -> list:
    """The earlier answers kept after an evaluation answered ``answer`` (token ids), of ``answers`` (the last
    answer, empty before the first, then the earlier ones kept) whose token ids are ``tokens``: the last first when
    the answer changed, at most `EARLIER_ANSWERS`, each once, never the answer itself (compared on the host)."""
    kept, held = [], []
    for index, (each, ids) in enumerate(zip(answers, tokens)):
        if len(kept) >= EARLIER_ANSWERS:
            break
        if (ids or index) and ids != answer and ids not in held:  # nothing to remember before the first answer
            kept.append(each)
            held.append(ids)
    return kept
