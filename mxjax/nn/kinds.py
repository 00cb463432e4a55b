"""What a GEMM's operands are: ``'weight'``, ``'head'`` or ``'activation'``, and why.

From the data flow (``mxjax.nn.analysis``): a GEMM is a ``'weight'`` site when at
least one operand is computed from parameters alone (a parameter, possibly cast,
reshaped, transposed or sliced), an ``'activation'`` site when both depend on
data. A weight site is an output ``'head'`` when one of these rules says so,
tried in this order (``Site.head_rule`` names the one that decided):

1. ``'tied'``: its weight is a parameter the program also reads with a ``gather``
   at data-dependent indices: the embedding table (``jnp.dot(x, embedding.T)``,
   ``Embed.attend``).
2. ``'structure'``: its result reaches the model's output without passing
   another GEMM, and its output width equals an embedding table's vocabulary
   (its number of rows). Both: the last linear layer of any model reaches the
   output, and an MLP may be as wide as the vocabulary.
3. ``'name'`` (the fallback, for models without an embedding, e.g. a classifier):
   its weight parameter's pytree path (``params/lm_head/kernel``) or its
   module path ends in a component fully matching ``rules.HEAD_NAMES``.
"""

from __future__ import annotations

import re

from mxjax.nn.analysis import Facts, Info
from mxjax.nn.paths import Path
from mxjax.nn.rules import HEAD_NAMES

__all__ = ["classify"]


def classify(eqn, lhs: Info, rhs: Info, path: Path, facts: Facts,
             head_params: frozenset) -> tuple[str, str, str]:
    """(kind, why, head rule or '') of a GEMM equation with operand Infos `lhs`, `rhs`."""
    if lhs.params is None and rhs.params is None:
        return "activation", "both operands depend on the inputs", ""
    sides = [n for n, i in (("lhs", lhs), ("rhs", rhs)) if i.params is not None]
    side = sides[0] if len(sides) == 1 else "lhs and rhs"
    params = frozenset().union(*(i.params for i in (lhs, rhs) if i.params is not None))
    if params & facts.tables:
        why = f"{side} is the embedding table (a parameter also read by a gather): a tied head"
        return "head", why, "tied"
    shape = eqn.outvars[0].aval.shape
    width = shape[-1] if shape else None
    if id(eqn) in facts.to_output and width in facts.vocabs:
        why = (f"{side} from parameters alone; its result is the model's output and its width "
               f"{width} is the embedding table's vocabulary")
        return "head", why, "structure"
    if params & head_params:
        return "head", f"{side} from a parameter named like an output head", "name"
    if path and re.fullmatch(HEAD_NAMES, path[-1]):
        why = f"{side} from parameters alone, in a module named like an output head"
        return "head", why, "name"
    what = "parameters alone" if params else "constants alone"
    return "weight", f"{side} computed from {what}", ""
