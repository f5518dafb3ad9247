"""A sequence mixer of the user's own code, a map over heads, run head-parallel under CP by registering it with
:func:`cpcompile.cores.register_head_parallel` (``tests/test_registered_cores.py``).

:func:`decayed_heads` is a per-head linear recurrence written in plain torch, as in a user's model file: for head
``h``, ``y_t = sum_{s <= t} lambda_h^(t - s) sigmoid(g_s) x_s`` with ``lambda_h = sigmoid(decay_h)``, computed as one
``[S, S]`` decay matrix per head (an ``arange`` of the length, a ``where``, an ``einsum`` that contracts the
sequence). ``x`` is ``[B, S, H, D]``, ``g`` ``[B, S, H]``, ``decay`` ``[H]``. The mixing pass refuses it under CP
unless it is registered (its einsum mixes tokens). :func:`mixed_heads` is the same recurrence plus the mean over
heads: registered, it is refused for the op that combines heads. :func:`restarting_heads` is the recurrence of
:func:`decayed_heads` restarted at every document start (``starts``, ``[B, S, H]``, 1.0 at a token whose position
id is 0, given as a per-token argument with a head dim, as ``docs/mixing.md`` says): the state does not cross
documents. :func:`looped_heads` is the recurrence of
:func:`decayed_heads` as a Python loop over the tokens (``h = lambda_h h + sigmoid(g_t) x_t``).

Never registered, for the backend to find (``regions="found"``, ``tests/test_found_regions.py``):
:func:`transposed_heads` is the loop of :func:`looped_heads` on ``[B, H, S, D]`` and ``[B, H, S]`` inputs (the heads
at dim 1, the sequence at dim 2); :func:`reversed_heads` runs it from the last token back (not causal);
:func:`heads_mixing_loop` adds the state's mean over heads at every step (not a map over heads);
:func:`rates_read_inside` reads its rates (per head and channel) from a module global (:data:`RATES`), not from
an argument; :func:`grouped_heads` is a loop whose state each step also multiplies by a per-token gate of
:data:`GROUPS` groups of heads (``sigmoid(k.sum(-1))``, ``k`` of ``[B, S, GROUPS, D]``: the sum keeps the channels
from being split instead), repeated to the heads as ``repeat_interleave`` does (group
``j`` to heads ``j * H / G`` to ``(j + 1) * H / G - 1``, as gated delta-net pairs key heads with value heads and
SSD its groups with heads); :func:`tiled_groups` repeats the groups the other way (``repeat``: group ``j`` to heads
``j``, ``j + G``, ...), so a rank's block of groups does not serve its block of heads; :func:`registered_groups` is
:func:`grouped_heads` under its own name, registered. Methods of
:class:`UserMixer` (:data:`METHODS`): ``scan_method``, the loop with a number read from ``self``, and
``rates_from_self``, the loop with per-head rates read from a parameter of ``self`` (not an argument, so not
narrowed to the rank's heads).

:func:`user_core_lm` (a ``ParityCase`` factory): a :class:`tests.models.tiny.TinyLM` whose ``mixer`` projects the
embeddings to ``HEADS`` heads of ``HEAD_DIM``, calls the core and projects back (residual), before one
packed-document attention layer. It registers the core in its process (the spawned ranks build the model too).
:data:`UNREGISTERED` names factories of it without arguments, its core not registered, for ``cpcompile inspect``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tests.models.attention import sdpa
from tests.models.tiny import TinyLM, seeded

HEADS = 6
HEAD_DIM = 4
#: How each core is registered: its per-token, per-head and shared arguments.
REGISTRATION = {"per_token": ("x", "g"), "per_head": ("decay",)}


def _decayed(x, g, decay):
    s = x.shape[1]
    pos = torch.arange(s, device=x.device)
    lag = (pos[:, None] - pos[None, :]).to(x.dtype)  # [S, S]: t - s
    rate = torch.sigmoid(decay)[:, None, None]  # [H, 1, 1]
    weights = torch.where(lag >= 0, rate ** lag.clamp(min=0), torch.zeros_like(lag))  # [H, S, S], causal
    return torch.einsum("hts,bshd->bthd", weights, x * torch.sigmoid(g).unsqueeze(-1))


def decayed_heads(x, g, decay):
    return _decayed(x, g, decay)


def mixed_heads(x, g, decay):
    y = _decayed(x, g, decay)
    return y + y.mean(dim=2, keepdim=True)


def looped_heads(x, g, decay):
    rate = torch.sigmoid(decay)[:, None]  # [H, 1]
    u = x * torch.sigmoid(g).unsqueeze(-1)
    h = torch.zeros_like(u[:, 0])
    out = []
    for t in range(u.shape[1]):
        h = rate * h + u[:, t]
        out.append(h)
    return torch.stack(out, dim=1)


def restarting_heads(x, g, decay, starts):
    u = x * torch.sigmoid(g).unsqueeze(-1)
    s = x.shape[1]
    pos = torch.arange(s, device=x.device)
    lag = (pos[:, None] - pos[None, :]).to(x.dtype)  # [S, S]: t - s
    rate = torch.sigmoid(decay)[:, None, None]  # [H, 1, 1]
    weights = torch.where(lag >= 0, rate ** lag.clamp(min=0), torch.zeros_like(lag))  # [H, S, S], causal
    doc = starts.cumsum(1)  # [B, S, H]: each token's document, counted from the sequence's start, per head
    same = (doc.unsqueeze(2) == doc.unsqueeze(1)).to(x.dtype)  # [B, T, S, H]: t and s in one document
    return torch.einsum("hts,btsh,bshd->bthd", weights, same, u)


def transposed_heads(x, g, decay):
    rate = torch.sigmoid(decay)[:, None]  # [H, 1]
    u = x * torch.sigmoid(g).unsqueeze(-1)  # [B, H, S, D]
    h = torch.zeros_like(u[:, :, 0])
    out = []
    for t in range(u.shape[2]):
        h = rate * h + u[:, :, t]
        out.append(h)
    return torch.stack(out, dim=2)


def reversed_heads(x, g, decay):
    rate = torch.sigmoid(decay)[:, None]
    u = x * torch.sigmoid(g).unsqueeze(-1)
    h = torch.zeros_like(u[:, 0])
    out = []
    for t in reversed(range(u.shape[1])):
        h = rate * h + u[:, t]
        out.append(h)
    return torch.stack(out[::-1], dim=1)


def heads_mixing_loop(x, g, decay):
    rate = torch.sigmoid(decay)[:, None]
    u = x * torch.sigmoid(g).unsqueeze(-1)
    h = torch.zeros_like(u[:, 0])
    out = []
    for t in range(u.shape[1]):
        h = rate * h + u[:, t] + 0.1 * h.mean(dim=1, keepdim=True)
        out.append(h)
    return torch.stack(out, dim=1)


#: Per-head, per-channel rates the module holds, which :func:`rates_read_inside` reads instead of taking them as an
#: argument.
RATES = torch.linspace(0.2, 0.8, HEADS * HEAD_DIM).view(HEADS, HEAD_DIM)


def rates_read_inside(x, g, decay):
    u = x * torch.sigmoid(g).unsqueeze(-1)
    h = torch.zeros_like(u[:, 0])
    out = []
    for t in range(u.shape[1]):
        h = RATES * h + u[:, t]
        out.append(h)
    return torch.stack(out, dim=1)


#: Groups of heads (``k`` of :func:`grouped_heads` and :func:`tiled_groups`): each serves ``HEADS // GROUPS`` heads.
GROUPS = 2


def grouped_heads(x, g, decay, k):
    rate = torch.sigmoid(decay)[:, None]
    gate = torch.sigmoid(k.sum(-1, keepdim=True)).repeat_interleave(
        x.shape[2] // k.shape[2], dim=2
    )  # group j -> heads j*H/G ...
    u = x * torch.sigmoid(g).unsqueeze(-1)
    h = torch.zeros_like(u[:, 0])
    out = []
    for t in range(u.shape[1]):
        h = rate * h * gate[:, t] + u[:, t]
        out.append(h)
    return torch.stack(out, dim=1)


def tiled_groups(x, g, decay, k):
    rate = torch.sigmoid(decay)[:, None]
    gate = torch.sigmoid(k.sum(-1, keepdim=True)).repeat(
        1, 1, x.shape[2] // k.shape[2], 1
    )  # group j -> heads j, j + G, ...
    u = x * torch.sigmoid(g).unsqueeze(-1)
    h = torch.zeros_like(u[:, 0])
    out = []
    for t in range(u.shape[1]):
        h = rate * h * gate[:, t] + u[:, t]
        out.append(h)
    return torch.stack(out, dim=1)


def registered_groups(x, g, decay, k):
    """:func:`grouped_heads` under a name of its own, for registration (a process that found ``grouped_heads``
    keeps it registered as found)."""
    return grouped_heads(x, g, decay, k)


CORES = {
    "decayed_heads": decayed_heads,
    "mixed_heads": mixed_heads,
    "looped_heads": looped_heads,
    "restarting_heads": restarting_heads,
    "transposed_heads": transposed_heads,
    "reversed_heads": reversed_heads,
    "heads_mixing_loop": heads_mixing_loop,
    "rates_read_inside": rates_read_inside,
    "grouped_heads": grouped_heads,
    "tiled_groups": tiled_groups,
    "registered_groups": registered_groups,
}
#: Cores that take ``[B, H, S, ...]`` inputs and return ``[B, H, S, D]``: the mixer transposes around them.
TRANSPOSED = frozenset({"transposed_heads"})
#: The per-token argument ``restarting_heads`` takes besides those of :data:`REGISTRATION`: document starts.
STARTS = {"restarting_heads": ("starts",)}
#: Cores that take a fourth argument, ``k``: ``[B, S, GROUPS, HEAD_DIM]``, per token, a gate for each group of heads.
GROUPED = frozenset({"grouped_heads", "tiled_groups", "registered_groups"})


def register(core: str) -> None:
    from cpcompile.cores import register_head_parallel

    per_token = REGISTRATION["per_token"] + STARTS.get(core, ()) + (("k",) if core in GROUPED else ())
    register_head_parallel(CORES[core], **{**REGISTRATION, "per_token": per_token})


#: Cores that are methods of :class:`UserMixer`, called as ``self.<core>(x, g, decay)``.
METHODS = frozenset({"scan_method", "rates_from_self"})


class UserMixer(nn.Module):
    def __init__(self, core: str, hidden: int, heads: int = HEADS, groups: int = GROUPS) -> None:
        super().__init__()
        self.core = core
        self.heads = heads
        self.groups = groups
        self.inp = nn.Linear(hidden, heads * HEAD_DIM)
        self.gate = nn.Linear(hidden, heads)
        self.decay = nn.Parameter(torch.linspace(-1.0, 2.0, heads))
        self.out = nn.Linear(heads * HEAD_DIM, hidden)
        self.input_scale = 0.5  # read by scan_method from self: a number, the same for every head
        if core == "rates_from_self":
            self.rates = nn.Parameter(torch.linspace(0.2, 0.8, heads * HEAD_DIM).view(heads, HEAD_DIM))
        if core in GROUPED:
            self.group_gate = nn.Linear(hidden, groups * HEAD_DIM)

    def scan_method(self, x, g, decay):
        rate = torch.sigmoid(decay)[:, None]
        h = torch.zeros_like(x[:, 0])
        out = []
        for t in range(x.shape[1]):
            h = rate * h + self.input_scale * x[:, t] * torch.sigmoid(g[:, t]).unsqueeze(-1)
            out.append(h)
        return torch.stack(out, dim=1)

    def rates_from_self(self, x, g, decay):
        h = torch.zeros_like(x[:, 0])
        out = []
        for t in range(x.shape[1]):
            h = torch.sigmoid(self.rates) * h + x[:, t] * torch.sigmoid(g[:, t]).unsqueeze(-1)
            out.append(h)
        return torch.stack(out, dim=1)

    def forward(self, x, batch=None):
        import tests.models.user_cores as module

        args = [self.inp(x).unflatten(-1, (self.heads, HEAD_DIM)), self.gate(x), self.decay]
        if self.core in STARTS:  # 1.0 at each document's first token (its position id 0), given to every head
            args.append((batch["position_ids"] == 0).to(x.dtype)[:, :, None].expand(-1, -1, self.heads))
        if self.core in GROUPED:
            args.append(self.group_gate(x).unflatten(-1, (self.groups, HEAD_DIM)))
        if self.core in TRANSPOSED:
            args = [args[0].transpose(1, 2), args[1].transpose(1, 2), args[2]]
        y = getattr(self if self.core in METHODS else module, self.core)(*args)
        if self.core in TRANSPOSED:
            y = y.transpose(1, 2)
        return x + self.out(y.flatten(-2))


def user_core_lm(
    *,
    seed: int = 0,
    core: str = "decayed_heads",
    registered: bool = True,
    hidden: int = 32,
    heads: int = HEADS,
    groups: int = GROUPS,
) -> TinyLM:
    """:class:`TinyLM` with a :class:`UserMixer` of ``heads`` heads (``groups`` groups of them for the cores of
    :data:`GROUPED`) calling ``core``, registered first when ``registered``."""
    if registered:
        register(core)

    def build() -> TinyLM:
        return TinyLM([sdpa("packed_docs")], hidden=hidden, mixer=UserMixer(core, hidden, heads, groups))

    return seeded(build, seed=seed)


#: How :class:`InlineMixer` computes its recurrence: ``"loop"``, a Python loop over the tokens in its ``forward``;
#: ``"matrix"``, the decay matrix of :func:`decayed_heads` built in its ``forward``; ``"function"``, a call of
#: :func:`decayed_heads` (the same values, in a function of its own, which runs head-parallel).
INLINE_FORMS = ("loop", "matrix", "function")


class InlineMixer(nn.Module):
    """A mixer whose scan is inline in its ``forward``: per-token projections to ``HEADS`` heads, the per-head
    recurrence of :func:`looped_heads` (as ``form`` says: :data:`INLINE_FORMS`), then an RMS norm across the heads
    (which combines heads, so no share of them can run it) and the projection back (residual)."""

    def __init__(self, hidden: int, heads: int = HEADS, form: str = "loop") -> None:
        super().__init__()
        self.form = form
        self.heads = heads
        self.inp = nn.Linear(hidden, heads * HEAD_DIM)
        self.gate = nn.Linear(hidden, heads)
        self.decay = nn.Parameter(torch.linspace(-1.0, 2.0, heads))
        self.norm = nn.RMSNorm(heads * HEAD_DIM)
        self.out = nn.Linear(heads * HEAD_DIM, hidden)

    def forward(self, x, batch=None):
        v = self.inp(x).unflatten(-1, (self.heads, HEAD_DIM))
        if self.form == "function":
            return x + self.out(self.norm(decayed_heads(v, self.gate(x), self.decay).flatten(-2)))
        u = v * torch.sigmoid(self.gate(x)).unsqueeze(-1)
        if self.form == "matrix":
            pos = torch.arange(u.shape[1], device=u.device)
            lag = (pos[:, None] - pos[None, :]).to(u.dtype)
            rate = torch.sigmoid(self.decay)[:, None, None]
            weights = torch.where(lag >= 0, rate ** lag.clamp(min=0), torch.zeros_like(lag))
            return x + self.out(self.norm(torch.einsum("hts,bshd->bthd", weights, u).flatten(-2)))
        rate = torch.sigmoid(self.decay)[:, None]
        h = torch.zeros_like(u[:, 0])
        out = []
        for t in range(u.shape[1]):
            h = rate * h + u[:, t]
            out.append(h)
        return x + self.out(self.norm(torch.stack(out, dim=1).flatten(-2)))


#: How :class:`InlineMixer`'s ``forward`` is registered to run whole on every rank.
INLINE_REGISTRATION = {"per_token": ("x",), "shared": ()}


def inline_forward_lm(
    *, seed: int = 0, registered: bool = True, hidden: int = 32, heads: int = HEADS, form: str = "loop"
) -> TinyLM:
    """:class:`TinyLM` with an :class:`InlineMixer` of ``form``, its ``forward`` first registered with
    :func:`cpcompile.cores.register_replicated` when ``registered`` (``form="function"``: :func:`decayed_heads`
    registered with :func:`cpcompile.cores.register_head_parallel` instead)."""
    if registered and form == "function":
        register("decayed_heads")
    elif registered:
        from cpcompile.cores import register_replicated

        register_replicated(InlineMixer.forward, **INLINE_REGISTRATION)

    def build() -> TinyLM:
        return TinyLM([sdpa("packed_docs")], hidden=hidden, mixer=InlineMixer(hidden, heads, form))

    return seeded(build, seed=seed)


def _unregistered(core: str):
    def factory() -> TinyLM:
        return user_core_lm(core=core, registered=False)

    factory.__name__ = factory.__qualname__ = f"{core}_lm"
    return factory


#: ``cpcompile inspect tests.models.user_cores:<name>_lm``: :func:`user_core_lm` of the core ``<name>``, unregistered.
UNREGISTERED = ("decayed_heads", "tiled_groups", "scan_method")
decayed_heads_lm, tiled_groups_lm, scan_method_lm = (_unregistered(core) for core in UNREGISTERED)
