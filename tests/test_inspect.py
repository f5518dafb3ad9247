"""`cpcompile inspect` and the backend's dump_dir: the table's rows, the dump's files, determinism, errors.

Expected values are derived here from the configs and the documented formulas, never read back from the tool:
bytes = (N - 1) * numel * itemsize of the gathered shapes, the PNG size from the formula in the docs, the
attention pattern from the document lengths. A real 2-process training run checks the predicted bytes
against the collectives the runtime counted.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import cpcompile
from cpcompile.__main__ import main
from cpcompile.testing import packed_batch, tiny_config, tiny_model
from tests.harness.dist import run_alone, run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA_DOCS = [10, 20, 34]  # T = 64, CP = 2: document 3 straddles the two ranks
QWEN_DOCS = [[10, 20, 18], [48]]  # T = 48, two rows


def _docs_arg(row):
    return ",".join(map(str, row))


def _run_cli(*args, timeout=240):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "cpcompile", "inspect", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _main_captured(argv: list[str]) -> tuple[int, str, str]:
    """``cpcompile inspect``'s ``main(argv)``: (exit code, stdout, stderr)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _expected_files(ranks, graphs=1):
    files = {"summary.json", "attention_pattern.png"}
    for r in ranks:
        files |= {f"rank{r}/summary.json"} | {
            f"rank{r}/graph{n}_{s}.py" for n in range(graphs) for s in ("before", "after")
        }
    return files


def _files_under(root):
    return {os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/") for d, _, fs in os.walk(root) for f in fs}


def _gather_bytes(shape, cp_size, dtype):
    return (cp_size - 1) * math.prod(shape) * getattr(torch, dtype).itemsize


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("configs")
    paths = {}
    for family in ("llama", "qwen3"):
        paths[family] = str(root / family)
        tiny_config(family).save_pretrained(paths[family])
    tiny_config("llama", attention_dropout=0.1).save_pretrained(str(root / "llama_dropout"))
    paths["llama_dropout"] = str(root / "llama_dropout")
    return paths


@pytest.fixture(scope="module")
def cli_llama(configs, tmp_path_factory):
    """One command-line run on tiny Llama, CP=2, T=64, with a dump, in a new process forked from the harness's fork
    server (the console entry point itself: ``test_console_entry_point_exit_code_and_message``)."""
    dump = str(tmp_path_factory.mktemp("cli") / "dump")
    argv = [configs["llama"], "--cp-size", "2", "--seq-len", "64", "--docs", _docs_arg(LLAMA_DOCS), "--dump", dump]
    code, stdout, stderr = run_alone(_main_captured, ["inspect", *argv])
    assert code == 0, stderr
    return stdout, dump


@pytest.fixture(scope="module")
def qwen3_inspection(configs):
    return cpcompile.inspect.inspect_model(configs["qwen3"], cp_size=2, seq_len=48, doc_lens=QWEN_DOCS)


def test_cli_table_and_summary_rows_llama(cli_llama):
    stdout, dump = cli_llama
    config = tiny_config("llama")
    site_lines = [line for line in stdout.splitlines() if "self_attn" in line]
    assert len(site_lines) == config.num_hidden_layers  # one row per site: identical on both ranks
    for i, line in enumerate(site_lines):
        assert f"model.layers.{i}.self_attn" in line and "rewritten" in line and "bool-mask" in line
        assert line.split()[0] == "all"
    with open(os.path.join(dump, "summary.json")) as f:
        summary = json.load(f)
    sites = summary["sites"]
    assert len(sites) == 2 * config.num_hidden_layers  # per rank
    assert {(s["rank"], s["layer"]) for s in sites} == {
        (r, f"model.layers.{i}.self_attn") for r in (0, 1) for i in range(config.num_hidden_layers)
    }
    c = 32  # 64 tokens over 2 ranks
    for s in sites:
        assert s["action"] == "rewritten" and s["mask_form"] == "bool-mask" and not s["enable_gqa"]
        assert s["q_shape"] == [1, config.num_attention_heads, c, config.head_dim]
        assert s["q_heads"] == config.num_attention_heads
        assert s["kv_heads"] == config.num_key_value_heads
        assert len(s["gathered_shapes"]) == 2
        expected = 0
        for shape in s["gathered_shapes"]:
            assert shape[0] == 1 and shape[2] == c and shape[3] == config.head_dim
            assert shape[1] == config.num_key_value_heads  # gathered before repeat_kv: KV heads only
            expected += _gather_bytes(shape, 2, "float32")
        assert s["all_gather_bytes_per_call"] == expected
        assert s["calls_per_forward"] == 1
        assert s["all_gather_bytes_per_step"] == expected
        assert s["reduce_scatter_bytes_per_step"] == expected  # K and V both need grad in training
    for t in summary["rank_totals"]:
        assert t["all_gathers"] == 2 * config.num_hidden_layers
        assert t["all_gather_bytes"] == sum(s["all_gather_bytes_per_step"] for s in sites if s["rank"] == t["rank"])
    # visible pairs: causal and same document, counted from the document lengths, for each of the 2 layers. The
    # 64 tokens are one block of 128, so every layout computes the same work and the default balanced layout
    # keeps the contiguous chunks; each rank's one query block computes all 64 keys.
    assert summary["layout"] == "balanced"
    docs = torch.repeat_interleave(torch.arange(3), torch.tensor(LLAMA_DOCS))
    i = torch.arange(64)
    visible = (i[None, :] <= i[:, None]) & (docs[None, :] == docs[:, None])
    layers = config.num_hidden_layers
    per_rank = [int(visible[:32].sum()), int(visible[32:].sum())]
    assert [t["visible_pairs"] for t in summary["rank_totals"]] == [layers * v for v in per_rank]
    assert [t["computed_pairs"] for t in summary["rank_totals"]] == [layers * 32 * 64] * 2


def test_cli_dump_files_png_and_graph_code(cli_llama):
    from PIL import Image

    _, dump = cli_llama
    assert _files_under(dump) == _expected_files([0, 1])
    with open(os.path.join(dump, "summary.json")) as f:
        assert set(json.load(f)["files"]) == _expected_files([0, 1])

    # Documented geometry: cells = 64 tokens (<= 128), 512 // 64 = 8 px per cell, panel 512,
    # width = 56 + 1 * (512 + 16), height = 24 + 512 + 24.
    with Image.open(os.path.join(dump, "attention_pattern.png")) as im:
        im.verify()
    with Image.open(os.path.join(dump, "attention_pattern.png")) as im:
        assert im.format == "PNG" and im.size == (584, 560)
        rgb = im.convert("RGB")
        docs = torch.repeat_interleave(torch.arange(3), torch.tensor(LLAMA_DOCS)).tolist()
        colors = {}
        for qi in range(64):
            for kj in range(64):
                px = rgb.getpixel((56 + kj * 8 + 4, 24 + qi * 8 + 4))
                visible = kj <= qi and docs[kj] == docs[qi]
                colors.setdefault((visible, qi // 32), set()).add(px)
    masked = colors[(False, 0)] | colors[(False, 1)]
    assert len(masked) == 1  # one colour for every masked pair
    assert not masked & (colors[(True, 0)] | colors[(True, 1)])
    assert not colors[(True, 0)] & colors[(True, 1)]  # each rank's rows in its own colours

    for rank in (0, 1):
        before = open(os.path.join(dump, f"rank{rank}", "graph0_before.py")).read()
        after = open(os.path.join(dump, f"rank{rank}", "graph0_after.py")).read()
        assert "cpcompile__compat_all_gather_start(" not in before and "site_plan.default(" not in before
        assert after.count("= cpcompile__compat_all_gather_start(") == 4  # K and V of 2 layers
        assert after.count("= cpcompile__compat_all_gather_wait(") == 4
        assert after.count("torch.ops.cpcompile.site_plan.default(") == 2
        for code in (before, after):
            namespace = {}
            exec(compile(code, "graph.py", "exec"), namespace)  # runnable: every name it uses is imported
            assert issubclass(namespace["GraphModule"], torch.nn.Module)
        with open(os.path.join(dump, f"rank{rank}", "summary.json")) as f:
            per_rank = json.load(f)
        assert per_rank["rank"] == rank and [g["after"] for g in per_rank["graphs"]] == ["graph0_after.py"]
        assert [s["action"] for s in per_rank["graphs"][0]["sites"]] == ["rewritten", "rewritten"]


def test_function_dump_is_byte_identical_to_cli_dump(cli_llama, configs, tmp_path):
    _, cli_dump = cli_llama
    result = cpcompile.inspect.inspect_model(configs["llama"], cp_size=2, seq_len=64, doc_lens=[LLAMA_DOCS])
    written = cpcompile.inspect.write_dump(result, str(tmp_path / "again"))
    assert {os.path.relpath(p, tmp_path / "again") for p in written} == _expected_files([0, 1])
    for rel in sorted(_expected_files([0, 1])):
        with open(os.path.join(cli_dump, rel), "rb") as a, open(tmp_path / "again" / rel, "rb") as b:
            assert a.read() == b.read(), rel


def test_qwen3_rows_two_rows_of_packed_documents(qwen3_inspection):
    config = tiny_config("qwen3")
    rows = qwen3_inspection.rows
    assert len(rows) == 2 * config.num_hidden_layers
    assert qwen3_inspection.padded_len == 48 and qwen3_inspection.chunk_len == 24
    for row in rows:
        assert row.action == "rewritten" and row.mask_form == "bool-mask"
        assert row.q_shape == (2, config.num_attention_heads, 24, config.head_dim)
        assert row.q_heads == config.num_attention_heads
        expected = sum(_gather_bytes(s, 2, "float32") for s in row.gathered_shapes)
        assert row.all_gather_bytes_per_call == expected > 0
        assert all(s[:1] == (2,) and s[2:] == (24, config.head_dim) for s in row.gathered_shapes)
    text = qwen3_inspection.report()
    site_lines = [line for line in text.splitlines() if "self_attn" in line]
    assert len(site_lines) == config.num_hidden_layers and all(" rewritten " in line for line in site_lines)


def test_refused_sites_are_listed_with_the_reason(configs, capsys):
    assert main(["inspect", configs["llama_dropout"], "--cp", "2", "--seq-len", "16", "--rank", "0"]) == 0
    out = capsys.readouterr().out
    refused = [line for line in out.splitlines() if "self_attn" in line]
    assert len(refused) == 2 and all("refused: attention dropout p=0.1" in line for line in refused)
    assert refused[0].split()[0] == "0"  # only rank 0 traced


def tiny_llama_eager():
    """A model factory for the tests: tiny Llama with eager attention (matmul + softmax, no SDPA call)."""
    return tiny_model("llama", attn_implementation="eager")


def mlp_only():
    """A model factory for the tests: a causal-LM-shaped model without any attention."""
    from tests.models import attention as _models

    return _models.mlp_lm()


def test_model_without_sdpa_says_so_and_exits_zero(capsys, tmp_path):
    code = main(
        [
            "inspect",
            "tests.test_inspect:mlp_only",
            "--cp-size",
            "2",
            "--seq-len",
            "16",
            "--rank",
            "1",
            "--dump",
            str(tmp_path / "d"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "no scaled_dot_product_attention call found" in out and "0 SDPA site(s)" in out
    assert _files_under(tmp_path / "d") == _expected_files([1])


def test_eager_attention_is_listed_as_refused(capsys):
    code = main(["inspect", "tests.test_inspect:tiny_llama_eager", "--cp-size", "2", "--seq-len", "16", "--rank", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "refused" in out and "attn_implementation='sdpa'" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["no/such/config.json", "--cp-size", "2", "--seq-len", "16"], "unknown model spec 'no/such/config.json'"),
        (["no_such_module_xyz:make", "--cp-size", "2", "--seq-len", "16"], "cannot import module 'no_such_module_xyz'"),
        (
            ["cpcompile.testing:no_such_factory", "--cp-size", "2", "--seq-len", "16"],
            "has no attribute 'no_such_factory'",
        ),
        (["cpcompile.testing:FAMILIES", "--cp-size", "2", "--seq-len", "16"], "is a dict, not a function"),
        (["{emptyjson}", "--cp-size", "2", "--seq-len", "16"], "should have a `model_type` key"),
        (["{llama}", "--cp-size", "0", "--seq-len", "16"], "cp_size must be a positive int"),
        (["{llama}", "--cp-size", "32", "--seq-len", "16"], "CP size 32 does not fit a sequence of 16 tokens"),
        (["{llama}", "--cp-size", "2", "--seq-len", "16", "--docs", "4,4"], "sums to 8 tokens, but seq_len is 16"),
        (["{llama}", "--cp-size", "2", "--seq-len", "16", "--docs", "4,x"], "not a comma-separated list"),
        (["{llama}", "--cp-size", "2", "--seq-len", "16", "--rank", "2"], "expected distinct ranks in [0, 2)"),
        (["{llama}", "--cp-size", "2", "--seq-len", "16", "--dump", "{nonempty}"], "the folder is not empty"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv, message, configs, tmp_path, capsys):
    (tmp_path / "nonempty").mkdir()
    (tmp_path / "nonempty" / "old.txt").write_text("x")
    (tmp_path / "empty.json").write_text("{}")
    argv = [
        a.format(llama=configs["llama"], nonempty=tmp_path / "nonempty", emptyjson=tmp_path / "empty.json")
        for a in argv
    ]
    with pytest.raises(SystemExit) as exc:
        main(["inspect", *argv])
    assert exc.value.code == 2
    assert message.lower() in capsys.readouterr().err.lower()


def test_console_entry_point_exit_code_and_message():
    proc = _run_cli("no/such/config.json", "--cp-size", "2", "--seq-len", "16", timeout=120)
    assert proc.returncode == 2
    assert "cpcompile inspect: error: unknown model spec 'no/such/config.json'" in proc.stderr
    assert proc.stdout == ""


def test_write_dump_refuses_a_non_empty_folder(qwen3_inspection, tmp_path):
    (tmp_path / "x").write_text("keep me")
    with pytest.raises(ValueError, match="is not empty"):
        cpcompile.inspect.write_dump(qwen3_inspection, str(tmp_path))
    assert os.listdir(tmp_path) == ["x"]


# -- dumps from a real 2-process training step ------------------------------------------------------------
def _train_with_dump(rank, world_size, dump_dir):
    import torch.distributed as dist

    os.environ["CPCOMPILE_DUMP_DIR"] = dump_dir  # the environment variable turns the dump on
    model = tiny_model("qwen3")
    group = dist.new_group(list(range(world_size)))
    compiled = torch.compile(model, backend=cpcompile.backend(group, inner="eager"))
    batch = packed_batch(QWEN_DOCS, seed=1)
    with cpcompile.shard(batch, group) as local:
        out = compiled(**local)
        out.loss.backward()
    stats = cpcompile.comm_stats()
    files = sorted(_files_under(os.path.join(dump_dir, f"rank{rank}")))
    return {
        "files": files,
        "all_gather_bytes": stats.all_gather_bytes,
        "all_gathers": stats.all_gathers,
        "reduce_scatter_bytes": stats.reduce_scatter_bytes,
    }


def test_training_dump_matches_inspect_prediction(qwen3_inspection, tmp_path):
    results = run_distributed(_train_with_dump, 2, str(tmp_path))
    for rank, res in enumerate(results):
        assert res["files"] == ["graph0_after.py", "graph0_before.py", "summary.json"]
        with open(tmp_path / f"rank{rank}" / "summary.json") as f:
            summary = json.load(f)
        sites = summary["graphs"][0]["sites"]
        assert summary["rank"] == rank and [s["action"] for s in sites] == ["rewritten", "rewritten"]
        assert "cpcompile__compat_all_gather_start(" in (tmp_path / f"rank{rank}" / "graph0_after.py").read_text()
        predicted = [r for r in qwen3_inspection.rows if r.rank == rank]
        totals = qwen3_inspection.totals[rank]
        # what inspect predicted from one fake-group trace == what the runtime counted in the real step
        assert res["all_gathers"] == totals.all_gathers
        assert res["all_gather_bytes"] == totals.all_gather_bytes == sum(r.all_gather_bytes_per_step for r in predicted)
        assert res["reduce_scatter_bytes"] == totals.reduce_scatter_bytes
        # training graphs have a symbolic sequence length (shard marks it dynamic): the dump records the
        # gathered shapes with that symbol, and equals the prediction in every other dimension
        for s, r in zip(sites, predicted, strict=True):
            for dumped, shape in zip(s["gathered_shapes"], r.gathered_shapes, strict=True):
                assert isinstance(dumped[2], str) and dumped[:2] + dumped[3:] == list(shape[:2] + shape[3:])


def test_pattern_picture_of_a_long_sequence_uses_blocks():
    from cpcompile.inspect import attention_pattern_image

    # T = 300, CP = 3: ceil(300 / 128) = 3 tokens per cell, 100 cells, 512 // 100 = 5 px per cell, panel 500;
    # two batch rows: width = 56 + 2 * (500 + 16), height = 24 + 500 + 24.
    batch = packed_batch([[100, 200], [300]])
    image = attention_pattern_image(cpcompile.plan.build_plan(batch, 3, 0, layout="contiguous"), documents=True)
    assert image.size == (1088, 548)
    rgb = image.convert("RGB")

    def cell(row, i, j):  # centre of cell (i, j) of panel `row`
        return rgb.getpixel((56 + row * 516 + j * 5 + 2, 24 + i * 5 + 2))

    # queries 150..152 sit on rank 1 (tokens 100..199); keys 30..32 on rank 0, keys 120..122 on rank 1
    gathered, own, diagonal, masked = cell(1, 50, 10), cell(1, 50, 40), cell(1, 50, 50), cell(1, 10, 50)
    assert len({gathered, own, diagonal, masked}) == 4  # from the all-gather, own keys, partly visible, masked
    assert cell(0, 50, 10) == masked  # row 0: query 150 is in document 2, keys 30..32 in document 1
    assert cell(0, 50, 40) == own  # keys 120..122: same document, earlier, on rank 1 like the query
    assert cell(0, 10, 5) != cell(1, 50, 40)  # rank 0's rows have rank 0's colour


def test_auto_attention_is_the_block_loop_on_meta_as_on_cpu(qwen3_inspection):
    """meta stands in for CUDA: the default attention is the memory-bounded block loop on every device."""
    assert qwen3_inspection.options.attention == "auto"
    assert {row.kernel for row in qwen3_inspection.rows} == {"block"}


def test_meta_trace_matches_a_real_cpu_trace_in_bfloat16(configs):
    # dense: SDPA stays in the graph, so the two graphs compare as text
    kwargs = dict(cp_size=2, seq_len=16, doc_lens=[[5, 11]], ranks=[1], dtype="bfloat16", attention="dense")
    meta = cpcompile.inspect.inspect_model(configs["llama"], **kwargs)
    real = cpcompile.inspect.inspect_model(configs["llama"], device="cpu", **kwargs)
    assert meta.rows == real.rows and len(meta.rows) == 2
    # the same graph, up to the device of the tensors the model creates inside it (arange for the mask)
    assert meta.graphs[0].after.replace("device(type='meta')", "device(type='cpu')") == real.graphs[0].after
    for row in meta.rows:
        assert row.dtype == "bfloat16"
        assert row.all_gather_bytes_per_call == sum((2 - 1) * math.prod(s) * 2 for s in row.gathered_shapes)


def test_a_model_that_cannot_be_called_like_a_causal_lm_exits_1(capsys):
    # nn.Identity takes one positional input, not the causal-LM keyword batch
    assert main(["inspect", "torch.nn:Identity", "--cp-size", "2", "--seq-len", "8"]) == 1
    err = capsys.readouterr().err
    assert "tracing 'torch.nn:Identity' as rank 0 of 2 on meta failed" in err and "input_ids" in err


def tiny_llama_one_layer():
    """A model factory for the memory test: a transformers config of a 1-layer tiny Llama (built on meta)."""
    return tiny_config("llama", num_hidden_layers=1, max_position_embeddings=1 << 16)


def _inspect_peak_rss_kb(seq_len: int) -> int:
    """Peak resident memory (VmHWM) of this process after ``cpcompile inspect ... --dump`` at ``seq_len``."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        argv = ["inspect", "tests.test_inspect:tiny_llama_one_layer", "--cp-size", "4", "--seq-len", str(seq_len)]
        argv += ["--docs", f"{seq_len // 3},{seq_len - seq_len // 3}", "--rank", "0", "--dump", tmp + "/dump"]
        assert main(argv) == 0
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc (Linux)")
def test_inspect_peak_memory_at_4x_the_length_stays_under_2x():
    """Inspect with a dump (trace, totals, summary.json, the PNG) needs no memory quadratic in the length.

    Peak RSS of a new process forked from the test harness's fork server (VmHWM: that process only, the same
    preloaded modules in both), CP=4, one traced rank, 8,192 vs 32,768 tokens. A quadratic term would show:
    drawing the picture from every rank's dense mask needed T^2 bytes of bool plus 4 T^2 of int32 (0.3 GB at 8k,
    5 GB at 32k). Measured (torch 2.13 CPU): figures in BENCHMARKS.md ("inspect at long lengths").
    """
    small, large = (run_alone(_inspect_peak_rss_kb, n) for n in (8192, 4 * 8192))
    print(f"peak RSS: {small / 1024:.0f} MiB at 8k, {large / 1024:.0f} MiB at 32k")
    assert large < 2 * small, (small, large)


def test_inspect_lists_mixing_ops():
    """A model with a causal conv outside attention: the report and summary list it with what the backend does."""
    result = cpcompile.inspect.inspect_model("tests.models.mixing:mixer_lm", cp_size=2, seq_len=32)
    text = result.report()
    assert "ops that mix tokens along the sequence outside attention" in text, text
    rows = [line for line in text.splitlines() if "conv1d" in line]
    assert rows and "halo" in rows[0] and "mixer.conv" in rows[0], text
    mixing = {(m["rank"], m["op"], m["action"]) for m in result.to_json()["mixing"]}
    found = (("conv1d", "halo"), ("cross_entropy", "partial_sum"))
    assert mixing == {(r, op, a) for r in (0, 1) for op, a in found}
