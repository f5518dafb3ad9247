"""``cpcompile inspect``: what the backend does to a model, traced in one process without a cluster.

Main API: :func:`inspect_model` (trace the model as every CP rank, run the pass in report mode, collect one
:class:`RankSite` per SDPA site) and :func:`write_dump` (graphs before/after, ``summary.json`` and a PNG of each
rank's attention pattern). The command line is ``cpcompile inspect`` (:mod:`cpcompile.__main__`).

- :mod:`~cpcompile.inspect.load`: the model from a transformers config or ``module:factory`` (:func:`load_model`);
- :mod:`~cpcompile.inspect.batch`: the synthetic packed batch of given document lengths;
- :mod:`~cpcompile.inspect.trace`: :func:`inspect_model`, one fake-group trace per rank;
- :mod:`~cpcompile.inspect.report`: :class:`Inspection` and the tables it prints;
- :mod:`~cpcompile.inspect.picture`: the attention-pattern picture (:func:`attention_pattern_image`);
- :mod:`~cpcompile.inspect.dump`: :func:`write_dump`.

The rows of the positions pass list every position source the model computes from the local sequence length,
those of the mixing pass every other op that mixes tokens along the sequence (run on the whole sequence,
accounted for, or refused).
"""

from cpcompile.inspect.dump import write_dump
from cpcompile.inspect.load import load_model
from cpcompile.inspect.picture import PatternGeometry, attention_pattern_image, pattern_geometry
from cpcompile.inspect.report import Inspection, RankSite, RankTotals
from cpcompile.inspect.trace import inspect_model

__all__ = [
    "Inspection",
    "PatternGeometry",
    "RankSite",
    "RankTotals",
    "attention_pattern_image",
    "inspect_model",
    "load_model",
    "pattern_geometry",
    "write_dump",
]
