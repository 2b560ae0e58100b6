"""Where each parameter of the reference model lives on this rank: the contract between
``parallelize`` (which cuts the model) and everything that handles parameters afterwards —
the data-parallel engines, gradient clipping and the gathered-gradient parity tests.

A ``Placement`` is written for every parameter this rank holds, under its global name (the
name it has in the one-rank model, Hugging Face Llama/Mixtral style without the ``model.``
prefix). It says which piece of the global tensor this rank holds and which groups its
gradient is summed over:

* ``shape``        the global shape;
* ``dim, parts, index``  the rank holds chunk ``index`` of ``parts`` equal chunks along ``dim``
                   (``parts = 1``: the whole tensor). Tensor parallelism cuts in ``tp`` parts,
                   or in ``kv_heads`` parts when tp > kv_heads (each chunk then held by
                   tp/kv_heads ranks);
* ``grad_group``   the data-parallel group whose ranks hold the same piece and see other tokens:
                   ``dense`` (dp·ep·cp) or ``expert`` (dp·cp, for routed experts);
* ``grad_sum``     model-parallel groups over which the gradient is *partial* and must be
                   summed before the data-parallel reduction (e.g. ``("tp",)`` for norm weights
                   under sequence parallelism).

* ``copies``       pipeline ranks holding the same piece (2 for the embedding on the first and
                   the last stage, Megatron's embedding group; summed over ``embed``).

The global gradient norm counts every element once: a piece held by ``tp / parts`` tp ranks and
``copies`` pipeline ranks is weighted by ``parts / (tp·copies)`` (``norm_weight``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Placement:
    name: str
    shape: tuple[int, ...]
    dim: int = 0
    parts: int = 1
    index: int = 0
    grad_group: str = "dense"
    grad_sum: tuple[str, ...] = ()
    copies: int = 1

    def norm_weight(self, tp: int) -> float:
        """The share of this piece in the global norm: 1 / (tp and pipeline ranks holding the
        same piece)."""
        return self.parts / (tp * self.copies)

    def cut(self, dim: int, parts: int, index: int) -> Placement:
        return replace(self, dim=dim, parts=parts, index=index)


def replicated(named_params) -> dict[str, Placement]:
    """Every parameter whole on this rank (the one-rank model, before any cut)."""
    return {n: Placement(n, tuple(p.shape)) for n, p in named_params}
