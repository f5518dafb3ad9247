"""Toy per-channel recurrent cores, each registered under CP as a known core of the WKV form
(:data:`cpcompile.cores.CORES`: ``core(time_decay, time_first, key, value, state=None, return_state=False)``, with
``key``, ``value`` ``[B, S, C]`` exchanged by channels and ``time_decay``, ``time_first`` ``[C]`` narrowed to the
rank's channels), and a tiny LM that calls one of them: the controls of the mixing pass's proof that a head-parallel
region is a map over its heads (``tests/test_head_map.py``).

``channel_map`` keeps every channel apart (a decayed prefix sum along the sequence, per channel), and so does
``channel_product`` (its product of keys and values an einsum); the others are the same recurrence with one op
that combines channels: a ``sum`` over them, an ``einsum`` contracting them, a
``softmax`` over them, a ``sum`` of the per-channel parameter ``time_decay``, a ``reshape`` that merges the
channels into the dim a ``matmul`` then contracts, or a ``chunk`` of the channels into halves treated apart (on a
rank, the halves of its own channels, not of the model's).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def _recurrence(time_decay, time_first, key, value):
    """Per channel: ``exp(-exp(w)) ** t``-weighted prefix sums of ``k * v`` along the sequence, plus ``u * k * v``."""
    kv = key * value
    return torch.cumsum(kv * torch.exp(-torch.exp(time_decay)), dim=1) + torch.exp(time_first) * kv


def channel_map(time_decay, time_first, key, value, state=None, return_state=False):
    return _recurrence(time_decay, time_first, key, value), None


def channel_product(time_decay, time_first, key, value, state=None, return_state=False):
    """:func:`channel_map` with ``k * v`` written as an einsum that contracts nothing."""
    kv = torch.einsum("bsc,bsc->bsc", key, value)
    return _recurrence(time_decay, time_first, kv, torch.ones_like(value)), None


def channel_sum(time_decay, time_first, key, value, state=None, return_state=False):
    out = _recurrence(time_decay, time_first, key, value)
    return out + out.sum(dim=-1, keepdim=True), None


def channel_einsum(time_decay, time_first, key, value, state=None, return_state=False):
    out = _recurrence(time_decay, time_first, key, value)
    return torch.einsum("bsc,bsd->bsd", key, out), None


def channel_softmax(time_decay, time_first, key, value, state=None, return_state=False):
    return torch.softmax(_recurrence(time_decay, time_first, key, value), dim=-1), None


def decay_sum(time_decay, time_first, key, value, state=None, return_state=False):
    return _recurrence(time_decay - time_decay.sum(), time_first, key, value), None


def merged_matmul(time_decay, time_first, key, value, state=None, return_state=False):
    out = _recurrence(time_decay, time_first, key, value)
    b, s, c = out.shape
    pairs = out.reshape(b, s, c // 2, 2).transpose(-1, -2)  # [B, S, 2, C/2]: channel pairs split over two dims
    return (pairs @ pairs.transpose(-1, -2)).sum(-1).repeat_interleave(c // 2, dim=-1), None


def channel_halves(time_decay, time_first, key, value, state=None, return_state=False):
    first, second = _recurrence(time_decay, time_first, key, value).chunk(2, dim=-1)
    return torch.cat([first, -second], dim=-1), None


CORES = (
    "channel_map",
    "channel_product",
    "channel_sum",
    "channel_einsum",
    "channel_softmax",
    "decay_sum",
    "merged_matmul",
    "channel_halves",
)


class CoreLM(nn.Module):
    """Token embedding, a token shift (RWKV's: every token's input beside the previous token's), key and value
    projections, the core ``core`` (a name of :data:`CORES`), a projection to the vocabulary:
    ``model(input_ids, **_) -> logits``."""

    def __init__(self, core: str, vocab: int = 128, channels: int = 16) -> None:
        super().__init__()
        self.core = core
        self.embed = nn.Embedding(vocab, channels)
        self.key = nn.Linear(2 * channels, channels)
        self.value = nn.Linear(2 * channels, channels)
        self.time_decay = nn.Parameter(torch.linspace(-1.0, 1.0, channels))
        self.time_first = nn.Parameter(torch.zeros(channels))
        self.out = nn.Linear(channels, vocab)

    def forward(self, input_ids, **_):
        import tests.models.head_cores as cores_module

        x = self.embed(input_ids)
        x = torch.cat([x, F.pad(x, (0, 0, 1, -1))], dim=-1)
        core = getattr(cores_module, self.core)
        y, _ = core(self.time_decay, self.time_first, self.key(x), self.value(x))
        return self.out(y)
