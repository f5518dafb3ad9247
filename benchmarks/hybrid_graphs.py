"""What the hybrid and recurrent transformers families look like to cpcompile and to Dynamo.

For every family below a tiny model is built from its config (random weights, no download, ``use_cache=False``
as :func:`cpcompile.shard` passes it) and two things are measured in this one process, under a fake CP group of
2 (this process is rank 0; no data moves):

* **refusal**: the model is compiled with ``cpcompile.backend`` (inner ``eager``) and run once under ``shard`` on
  a packed batch; the first refusal is the exception the backend raises (as training would see it). The same
  model is then traced with the backend in ``trace_only`` mode, which lists every refusal instead of raising at
  the first: their number, by pass.
* **specialisation**: the model is compiled with a backend that only records Dynamo's graphs (no cpcompile
  pass), on ``shard``'s local batch (its sequence dim marked dynamic the way ``shard`` marks it:
  ``torch._dynamo.maybe_mark_dynamic``), at two global lengths without a reset in between. Per length: how
  many graphs Dynamo compiled (a second one is a recompile), whether the sequence dim of ``input_ids`` is still
  a symbol, the guards that mention that symbol (with the model line that made the first), and the number of
  FX nodes inside the first mixer module (``nn_module_stack``). Mixer nodes that grow with the length mean a
  Python loop over chunks (or tokens) unrolled into the graph.

``--retrace`` rewrites the gated delta rule's graph into a call of its Python function at twice the length
(re-traced by AOTAutograd) and checks it against eager; ``--dtensor`` runs the gated delta rule and a depthwise
conv on DTensors sharded over heads. ``--excerpt FAMILY`` prints the first mixer's FX nodes at the first
length (what enters and leaves the module, its shapes and the module each op comes from).

    PYTHONPATH=. python benchmarks/hybrid_graphs.py [--family NAME ...] [--lengths 64 160 166]
    PYTHONPATH=. python benchmarks/hybrid_graphs.py --no-table --excerpt qwen3_next --excerpt mamba2 --lengths 64
    PYTHONPATH=. python benchmarks/hybrid_graphs.py --no-table --retrace --dtensor
"""

from __future__ import annotations

import argparse
import collections
import re
import warnings

import sympy
import torch

import cpcompile
from benchmarks._common import print_table
from cpcompile import _compat
from cpcompile.backend import CPBackend
from cpcompile.options import BackendOptions
from cpcompile.testing import packed_batch

_SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
_ATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
# Mamba2-style mixers: heads x head_dim = expand x hidden = 128
_SSM2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
             mamba_chunk_size=16)  # fmt: skip
_GDN = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4)  # fmt: skip
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

#: family -> (model class, config class, config fields, path of the first mixer module). One layer of each kind,
#: the mixer first; the layer kinds are set explicitly.
FAMILIES: dict[str, tuple[str, str, dict, str]] = {
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig", {
        **_SMALL, **_ATTN, **_GDN, **_MOE, "shared_expert_intermediate_size": 32,
        "layer_types": ["linear_attention", "full_attention"]}, "model.layers.0.linear_attn"),
    "qwen3_5": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", {
        **_SMALL, **_ATTN, **_GDN, "layer_types": ["linear_attention", "full_attention"]},
        "model.layers.0.linear_attn"),
    "mamba2": ("Mamba2ForCausalLM", "Mamba2Config", {
        **_SMALL, "state_size": 8, "num_heads": 8, "head_dim": 16, "n_groups": 2, "expand": 2, "conv_kernel": 4,
        "chunk_size": 16}, "backbone.layers.0.mixer"),
    "mamba": ("MambaForCausalLM", "MambaConfig", {
        **_SMALL, "state_size": 8, "expand": 2, "conv_kernel": 4, "use_mambapy": False}, "backbone.layers.0.mixer"),
    "jamba": ("JambaForCausalLM", "JambaConfig", {
        **_SMALL, **_ATTN, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
        "expert_layer_offset": 1, "num_experts": 4, "num_experts_per_tok": 2, "mamba_d_state": 8, "mamba_d_conv": 4,
        "mamba_expand": 2, "use_mamba_kernels": False}, "model.layers.0.mamba"),
    "bamba": ("BambaForCausalLM", "BambaConfig", {
        **_SMALL, **_ATTN, **_SSM2, "attn_layer_indices": [1]}, "model.layers.0.mamba"),
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig", {
        **_SMALL, **_ATTN, **_SSM2, "layer_types": ["mamba", "attention"], "num_local_experts": 4,
        "num_experts_per_tok": 2, "shared_intermediate_size": 64}, "model.layers.0.mamba"),
    "falcon_h1": ("FalconH1ForCausalLM", "FalconH1Config", {  # every layer: attention and SSM side by side
        **_SMALL, **_ATTN, **_SSM2, "mamba_d_ssm": 128}, "model.layers.0.mamba"),
    "nemotron_h": ("NemotronHForCausalLM", "NemotronHConfig", {
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2,
        "ssm_state_size": 8, "conv_kernel": 4, "expand": 2, "chunk_size": 16, "use_mamba_kernels": False,
        "num_hidden_layers": 3, "layers_block_type": ["linear_attention", "full_attention", "mlp"]},
        "model.layers.0.mixer"),
    "recurrent_gemma": ("RecurrentGemmaForCausalLM", "RecurrentGemmaConfig", {
        **_SMALL, "num_attention_heads": 4, "lru_width": 64, "attention_window_size": 16, "conv1d_width": 4,
        "block_types": ["recurrent", "attention"]}, "model.layers.0.temporal_block"),
    "minimax": ("MiniMaxForCausalLM", "MiniMaxConfig", {
        **_SMALL, **_ATTN, "layer_types": ["linear_attention", "full_attention"], "num_local_experts": 4,
        "num_experts_per_tok": 2, "block_size": 16}, "model.layers.0.self_attn"),
}  # fmt: skip

#: Families without attention layers (no attention implementation to choose).
NO_ATTENTION = frozenset({"mamba", "mamba2"})

#: Local lengths tried against the first graph's guards (``_accepted``).
LENGTHS_UPTO = 256

DOCS = [[10, 22], [5, 27]]  # T = 32 for the refusal run: documents that cross the chunk edge at CP = 2


def build(family: str) -> torch.nn.Module:
    import transformers

    model_cls, config_cls, fields, _ = FAMILIES[family]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = getattr(transformers, config_cls)(**fields)
    if family not in NO_ATTENTION:
        config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).train()


def _docs(total: int) -> list[list[int]]:
    """Two rows of packed documents adding up to ``total`` (one document crosses the CP=2 chunk edge)."""
    a = total // 3
    return [[a, total - a], [total - 5, 5]]


def _short(e: BaseException, limit: int = 230) -> str:
    text = re.sub(r"\S*site-packages/transformers/", "", str(e).splitlines()[0]).split(" Fix: ")[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def refusal(family: str) -> dict:
    """The first refusal the backend raises, and every refusal trace-only mode lists, by pass."""
    out = {}
    with _compat.fake_process_group(0, 2) as group:
        torch.compiler.reset()
        model = build(family)
        try:
            with warnings.catch_warnings(), cpcompile.shard(packed_batch(DOCS), group) as local:
                warnings.simplefilter("ignore")
                torch.compile(model, backend=cpcompile.backend(group, inner="eager"))(**local)
            out["first refusal"] = "none: compiled"
        except (cpcompile.UnsupportedMixingError, cpcompile.UnsupportedAttentionError) as e:
            out["first refusal"] = f"{type(e).__name__}: {_short(e)}"
        except cpcompile.UnsupportedPositionError as e:
            out["first refusal"] = f"UnsupportedPositionError: {_short(e)}"
        except Exception as e:  # noqa: BLE001 - anything else is a finding of its own
            out["first refusal"] = f"error {type(e).__name__}: {_short(e)}"
        torch.compiler.reset()
        tracer = CPBackend(group, BackendOptions(inner="eager", dump_dir=None), trace_only=True, name="survey")
        try:
            with warnings.catch_warnings(), cpcompile.shard(packed_batch(DOCS), group) as local:
                warnings.simplefilter("ignore")
                torch.compile(build(family), backend=tracer)(**local)
        except Exception as e:  # noqa: BLE001 - reported in the table
            out["all refusals"] = f"trace failed: {type(e).__name__}"
            return out
        torch.compiler.reset()
    counts = collections.Counter()
    for g in tracer.traced:
        counts["attention"] += sum(r.action == "refused" for r in g.reports)
        counts["positions"] += sum(r.action == "refused" for r in g.positions)
        counts["mixing"] += sum(r.action == "refused" for r in g.mixing)
    out["all refusals"] = ", ".join(f"{k} {v}" for k, v in counts.items() if v) or "none"
    return out


class _Recorder:
    """A Dynamo backend that runs graphs as traced and records, per graph, what :func:`_graph_facts` reads."""

    def __init__(self, mixer: str) -> None:
        self.mixer = mixer
        self.graphs: list[dict] = []
        self.modules: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        shape_env = torch._guards.TracingContext.get().fake_mode.shape_env
        self.graphs.append(_graph_facts(gm, shape_env, self.mixer))
        self.modules.append(gm)
        return gm.forward


def _in_mixer(node: torch.fx.Node, mixer: str) -> bool:
    stack = node.meta.get("nn_module_stack") or {}
    return any(_path(p) == mixer or _path(p).startswith(mixer + ".") for p, _ in stack.values())


def _path(dynamo_path: str) -> str:
    """``L['self'].model.layers[0].linear_attn`` -> ``model.layers.0.linear_attn``."""
    p = re.sub(r"^L\['[a-z_]+'\](\[\d+\])?\.?", "", dynamo_path)
    p = re.sub(r"\._modules\['([^']+)'\]", r".\1", p)
    return re.sub(r"\[(\d+)\]", r".\1", p).lstrip(".")


def _seq_symbol(gm: torch.fx.GraphModule):
    for node in gm.graph.find_nodes(op="placeholder"):
        v = node.meta.get("example_value")
        if isinstance(v, torch.Tensor) and "input_ids" in node.name and v.dim() == 2:
            return v.shape[1]
    for node in gm.graph.find_nodes(op="placeholder"):  # a graph after a break: the first [B, T, ...] input
        v = node.meta.get("example_value")
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and isinstance(v.shape[1], torch.SymInt):
            return v.shape[1]
    return None


def _graph_facts(gm: torch.fx.GraphModule, shape_env, mixer: str) -> dict:
    seq = _seq_symbol(gm)
    if isinstance(seq, torch.SymInt) and not seq.node.expr.free_symbols:
        seq = int(seq)  # Dynamo specialised the length: a constant of this graph
    symbols = seq.node.expr.free_symbols if isinstance(seq, torch.SymInt) else set()
    guards = [g for g in shape_env.guards if symbols & g.expr.free_symbols]
    first_line = ""
    for g in guards:
        loc = str(getattr(g.sloc, "maybe_user_loc", "") or "")
        if "transformers" in loc:
            first_line = re.sub(r"\S*site-packages/transformers/", "", loc)
            break
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    return {
        "seq": str(seq.node.expr) if isinstance(seq, torch.SymInt) else f"{seq} (constant)",
        "guards": [str(g.expr) for g in guards],
        "accepted": _accepted(seq, guards),
        "holds_at": (lambda n: _holds(seq, guards, n)),
        "guard_line": first_line,
        "mixer_nodes": sum(_in_mixer(n, mixer) for n in calls),
        "nodes": len(calls),
    }


def _accepted(seq, guards, upto: int = LENGTHS_UPTO) -> tuple[int, ...] | None:
    """The local lengths in ``1..upto`` that satisfy every guard on the sequence symbol alone (the lengths this
    graph is reused for); ``None`` when the length is a constant in the graph."""
    if not isinstance(seq, torch.SymInt):
        return None
    (sym,) = seq.node.expr.free_symbols
    alone = [g.expr for g in guards if g.expr.free_symbols == {sym}]
    out = []
    for v in range(1, upto + 1):
        value = sympy.Integer(v)
        if all(bool(e.xreplace({sym: value})) for e in alone):
            out.append(v)
    return tuple(out)


def _holds(seq, guards, value: int) -> bool | None:
    """Whether every guard on the sequence symbol alone holds when the symbol is ``value`` (``None``: constant)."""
    if not isinstance(seq, torch.SymInt):
        return None
    (sym,) = seq.node.expr.free_symbols
    return all(bool(g.expr.xreplace({sym: sympy.Integer(value)})) for g in guards if g.expr.free_symbols == {sym})


def _describe(values: tuple[int, ...] | None) -> str:
    """``(16, 32, 48)`` -> ``16..48 step 16 (3)``; runs of other shapes as their first values."""
    if values is None:
        return "constant"
    if not values:
        return "none"
    if len(values) == 1:
        return f"only {values[0]}"
    step = values[1] - values[0]
    if all(b - a == step for a, b in zip(values, values[1:])):
        return f"{values[0]}..{values[-1]}" + (f" step {step}" if step > 1 else "") + f" ({len(values)})"
    return ", ".join(map(str, values[:6])) + f", ... ({len(values)})"


def specialisation(family: str, lengths: tuple[int, ...]) -> dict:
    """Compile once, run at each global length in turn, and record Dynamo's graphs."""
    recorder = _Recorder(FAMILIES[family][3])
    torch.compiler.reset()
    torch._dynamo.utils.counters.clear()
    model = build(family)
    compiled = torch.compile(model, backend=recorder)
    per_length = []
    with _compat.fake_process_group(0, 2) as group:
        for total in lengths:
            before = len(recorder.graphs)
            with warnings.catch_warnings(), cpcompile.shard(packed_batch(_docs(total)), group) as local:
                warnings.simplefilter("ignore")
                compiled(**local)
            per_length.append(recorder.graphs[before:])
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    torch.compiler.reset()
    first = per_length[0]
    row = {
        "graphs per length": " / ".join(str(len(g)) for g in per_length),
        "seq dim (first graph)": first[0]["seq"] if first else "-",
        "guards on seq": sum(len(g["guards"]) for g in first),
        f"local lengths the first graph accepts (1..{LENGTHS_UPTO})": _describe(first[0]["accepted"]) if first else "-",
        "first graph valid at the global T": " / ".join(
            f"{t}: {'yes' if first[0]['holds_at'](t) else 'no'}" for t in lengths
        )
        if first
        else "-",
        "first guard at": next((g["guard_line"] for g in first if g["guard_line"]), "-"),
        "mixer nodes per length": " / ".join(
            str(sum(g["mixer_nodes"] for g in gs)) if gs else "(reused)" for gs in per_length
        ),
        "graph breaks": breaks,
    }
    row["_modules"] = recorder.modules
    return row


def excerpt(family: str, lengths: tuple[int, ...], limit: int = 400) -> None:
    """Print the first mixer's nodes (at the first length): inputs from outside, ops, outputs used outside."""
    mixer = FAMILIES[family][3]
    row = specialisation(family, lengths[:1])
    gm = row["_modules"][0]
    inside = [n for n in gm.graph.nodes if n.op != "placeholder" and _in_mixer(n, mixer)]
    names = {n.name for n in inside}

    def shape(n):
        v = n.meta.get("example_value") if isinstance(n, torch.fx.Node) else None
        if isinstance(v, torch.Tensor):
            return f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
        if isinstance(v, (tuple, list)):
            return "(" + ", ".join(f"{list(t.shape)}" for t in v if isinstance(t, torch.Tensor)) + ")"
        return ""

    def sub(n):
        stack = n.meta.get("nn_module_stack") or {}
        return _path(list(stack.values())[-1][0]).removeprefix(mixer) or "."

    entering = {a for n in inside for a in n.all_input_nodes if a.name not in names}
    print(f"\n### {family}: FX nodes of {mixer} (seq symbol {row['seq dim (first graph)']})\n")
    for a in sorted(entering, key=lambda a: list(gm.graph.nodes).index(a)):
        print(f"  IN   {a.name:28s} {shape(a)}")
    for n in inside[:limit]:
        target = getattr(n.target, "__name__", str(n.target))
        outside = [u.name for u in n.users if u.name not in names]
        mark = "OUT " if outside else "    "
        print(f"  {mark} {n.name:28s} {target:26s} {shape(n):34s} {sub(n)}")
    if len(inside) > limit:
        print(f"  ... {len(inside) - limit} more nodes")


def dtensor_heads() -> list[dict]:
    """Can DTensor's op strategies run a mixer as a map over heads? The gated delta rule's torch path and a
    depthwise causal conv1d on inputs sharded over heads (channels), as rank 0 of a fake group of 2, against the
    whole computation: forward and gradient errors of this rank's heads, and every redistribution DTensor made
    (each is a collective on a real group). Tensors the function creates itself (its chunk mask, the zero
    state) are taken as replicated (``implicit_replication``); without it the first such op raises."""
    import torch.distributed.tensor._dispatch as dispatch
    from torch.distributed.tensor import DeviceMesh, DTensor, Shard
    from torch.distributed.tensor.experimental import implicit_replication
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    def gdn(q, k, v, g, beta):
        return torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]

    def conv(x, w):  # x [B, C, T] sharded over channels, w [C, 1, K] with it
        return torch.nn.functional.conv1d(x, w, padding=w.shape[-1] - 1, groups=w.shape[0])[..., : x.shape[-1]]

    gen = torch.Generator().manual_seed(0)
    B, T, Hk, Hv, D = 1, 96, 2, 4, 16
    cases = {
        "gated delta rule (Hk=2, Hv=4, T=96)": (gdn, 2, [
            torch.randn(B, T, Hk, D, generator=gen), torch.randn(B, T, Hk, D, generator=gen),
            torch.randn(B, T, Hv, D, generator=gen), -torch.rand(B, T, Hv, generator=gen),
            torch.rand(B, T, Hv, generator=gen)], [2, 2, 2, 2, 2]),
        "depthwise causal conv1d (C=8, K=4)": (conv, 1, [
            torch.randn(B, 8, T, generator=gen), torch.randn(8, 1, 4, generator=gen)], [1, 0]),
    }  # fmt: skip
    rows = []
    moves: list[str] = []
    original = dispatch.redistribute_local_tensor

    def spy(local, current, target, *args, **kwargs):
        if current.placements != target.placements:
            local_slice = current.placements[0].is_replicate() and target.placements[0].is_shard()
            how = "local slice" if local_slice else "collective"
            moves.append(f"{current.placements[0]}->{target.placements[0]} {list(current.shape)} ({how})")
        return original(local, current, target, *args, **kwargs)

    dispatch.redistribute_local_tensor = spy
    try:
        with _compat.fake_process_group(0, 2):
            mesh = DeviceMesh("cpu", [0, 1])
            for name, (fn, out_dim, full, dims) in cases.items():
                full = [x.requires_grad_() for x in full]
                ref = fn(*full)
                ref.narrow(out_dim, 0, ref.shape[out_dim] // 2).sum().backward()
                local = [x.detach().chunk(2, d)[0].clone().requires_grad_() for x, d in zip(full, dims)]
                args = [DTensor.from_local(x, mesh, [Shard(d)]) for x, d in zip(local, dims)]
                row = {"function": name}
                for phase in ("forward", "backward"):
                    moves.clear()
                    try:
                        with implicit_replication():
                            if phase == "forward":
                                out = fn(*args)
                            else:
                                out.to_local().sum().backward()
                    except Exception as e:  # noqa: BLE001 - a missing strategy is the finding
                        row[f"{phase} redistributions"] = f"error {type(e).__name__}: {str(e)[:80]}"
                        break
                    row[f"{phase} redistributions"] = "; ".join(sorted(set(moves))) or "none"
                else:
                    mine = ref.narrow(out_dim, 0, ref.shape[out_dim] // 2)
                    row["output placement"] = str(out.placements[0])
                    moved = "collective" in row["forward redistributions"] + row["backward redistributions"]
                    row["forward max error"] = float((out.to_local() - mine).abs().max())
                    row["grad max error"] = (
                        "n/a: a collective moved no data on the fake group"
                        if moved
                        else max(
                            float((xl.grad - x.grad.chunk(2, d)[0]).abs().max()) for x, xl, d in zip(full, local, dims)
                        )
                    )
                rows.append(row)
    finally:
        dispatch.redistribute_local_tensor = original
    return rows


def _gdn_inputs(length: int, gen: torch.Generator, dynamic: bool = True) -> list[torch.Tensor]:
    """``q, k [1, length, 2, 16]``, ``v [1, length, 4, 16]``, ``g, beta [1, length, 4]`` of the gated delta rule."""
    x = [
        torch.randn(1, length, 2, 16, generator=gen),
        torch.randn(1, length, 2, 16, generator=gen),
        torch.randn(1, length, 4, 16, generator=gen),
        -torch.rand(1, length, 4, generator=gen),
        torch.rand(1, length, 4, generator=gen),
    ]
    for t in x:
        if dynamic:
            torch._dynamo.maybe_mark_dynamic(t, 1)
    return x


def retrace() -> list[dict]:
    """A region rewritten into a call of the model's Python function at a longer length, re-traced by
    AOTAutograd: Dynamo traces ``torch_chunk_gated_delta_rule`` at the local length; the backend replaces the
    whole graph with a ``call_function`` of a function that runs it on the sequence and its reverse concatenated
    (twice the length: a stand-in for the all-to-all to the whole sequence) and folds the halves back. Rows:
    compiles per local length, the guard failure that triggered the recompile, and the errors against the same
    function run eagerly. Then the torch path itself under ``aot_eager`` with the length dynamic or static."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    def core(q, k, v, g, beta):
        return torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]

    def doubled(q, k, v, g, beta):
        n = q.shape[1]
        out = core(*(torch.cat([x, x.flip(1)], dim=1) for x in (q, k, v, g, beta)))
        return out[:, :n] + out[:, n:].flip(1)

    compiles = []

    def inner(gm, example_inputs):
        compiles.append(gm)
        return make_boxed_func(gm.forward)

    def rewrite(gm: torch.fx.GraphModule, example_inputs):
        placeholders = {n.name: n for n in gm.graph.find_nodes(op="placeholder")}
        args = tuple(placeholders[f"l_{a}_"] for a in ("q", "k", "v", "g", "beta"))  # Dynamo orders them by use
        (output,) = gm.graph.find_nodes(op="output")
        with gm.graph.inserting_before(output):
            call = gm.graph.call_function(doubled, args)
        output.args = ((call,),)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        return aot_autograd(fw_compiler=inner, bw_compiler=inner)(gm, example_inputs)

    rows = []
    torch.compiler.reset()
    torch._dynamo.utils.guard_failures.clear()
    compiled = torch.compile(core, backend=rewrite)
    gen = torch.Generator().manual_seed(0)
    for length in (24, 31, 40):
        x = _gdn_inputs(length, gen)
        mine, ref = ([t.clone().requires_grad_() for t in x] for _ in range(2))
        before = len(compiles)
        got = compiled(*mine)
        got.sum().backward()
        want = doubled(*ref)
        want.sum().backward()
        failures = [str(f) for fs in torch._dynamo.utils.guard_failures.values() for f in fs]
        torch._dynamo.utils.guard_failures.clear()
        rows.append({
            "case": f"region at 2x: local {length} -> {2 * length} tokens",
            "AOT graphs (fw+bw)": len(compiles) - before,
            "forward max error": float((got - want).abs().max()),
            "grad max error": max(float((a.grad - b.grad).abs().max()) for a, b in zip(mine, ref)),
            "recompiled by (guard failures)": " | ".join(re.sub(r"\s+", " ", f)[:110] for f in failures) or "-",
        })  # fmt: skip
    for dynamic in (True, False):
        torch.compiler.reset()
        compiled = torch.compile(core, backend="aot_eager", dynamic=None if dynamic else False)
        for length in (64, 128, 130, 192):
            try:
                compiled(*_gdn_inputs(length, gen, dynamic))
                outcome = "runs"
            except RuntimeError as e:
                outcome = f"RuntimeError: {str(e).splitlines()[0][:70]}"
            kind = "dynamic" if dynamic else "static"
            rows.append({"case": f"torch path, aot_eager, {kind} length {length}", "outcome": outcome})
    torch.compiler.reset()
    rows.append({"case": "substitute_in_graph of a Python function", "outcome": _substitution()})
    return rows


def _doubles(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _substitution() -> str:
    """Whether ``torch.compiler.substitute_in_graph`` swaps a plain Python function (not a C builtin) when Dynamo
    traces a caller, while eager calls keep the original: the pre-Dynamo hook a CP core wrapper could use."""

    def caller(x):
        return _doubles(x) + 1

    @torch.compiler.substitute_in_graph(_doubles)
    def _triples(x):
        return x * 3

    torch.compiler.reset()
    x = torch.ones(2)
    eager, compiled = caller(x)[0].item(), torch.compile(caller, backend="eager")(x)[0].item()
    torch.compiler.reset()
    return f"eager caller {eager:g} (x*2+1), compiled caller {compiled:g} (x*3+1 if substituted)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", action="append", choices=sorted(FAMILIES), help="default: every family")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 160, 166], help="global lengths (CP=2)")
    parser.add_argument("--excerpt", choices=sorted(FAMILIES), action="append", help="print a mixer's FX nodes")
    parser.add_argument("--no-table", action="store_true", help="only the excerpts (and --dtensor)")
    parser.add_argument("--dtensor", action="store_true", help="DTensor on head-sharded mixer inputs")
    parser.add_argument("--retrace", action="store_true", help="a region re-traced at a longer length")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lengths = tuple(args.lengths)
    for family in args.excerpt or []:
        excerpt(family, lengths)
    if args.dtensor:
        print_table("DTensor strategies on inputs sharded over heads (rank 0 of 2)", dtensor_heads())
    if args.retrace:
        print_table("the gated delta rule re-traced at twice the length, and under aot_eager", retrace())
    if args.no_table:
        return
    rows = []
    for family in args.family or FAMILIES:
        row = {"family": family}
        for part in (refusal, specialisation):
            try:
                found = part(family) if part is refusal else part(family, lengths)
            except Exception as e:  # noqa: BLE001 - a config this release rejects is a row, not a crash
                found = {part.__name__: f"not measured: {type(e).__name__}: {_short(e, 120)}"}
            found.pop("_modules", None)
            row.update(found)
        rows.append(row)
        print(row, flush=True)
    print_table(f"hybrid mixers at CP=2: refusals, and Dynamo's graphs at global lengths {lengths}", rows)


if __name__ == "__main__":
    main()
