"""``cpcompile.integrations.transformers``: Trainer and TRL's SFTTrainer at CP=2 (and dp=2 x cp=2) under torchrun.

Each run is launched as users launch training (``python -m torch.distributed.run --standalone --nproc-per-node N``,
CPU, gloo) and compared with the same trainer class run in one plain process on the same global batches
(``tests/_hf_trainer_worker.py``): the loss and grad norm the Trainer logs at every step, and the parameters after
the last step. Batches are taken in order, except in the dp=2 x cp=2 run, which shuffles (the Trainer's default).

The training launches are the slow tier. The fast tier checks the refusals (they come before any step) on two gloo
ranks forked from the test harness's fork server with torchrun's environment, and the message without torchrun in a
process with no process group.

Measured differences and the negative control's error: BENCHMARKS.md ("parity errors").
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.harness.dist import run_alone, run_distributed
from tests.harness.tiers import slow
from tests.harness.tolerances import LOSS_TOL, NORM_TOL, TRAINER_PARAM_TOL

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "_hf_trainer_worker.py"

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("accelerate") is None,
        reason="transformers.Trainer needs accelerate (pip install accelerate)",
    ),
    pytest.mark.timeout(900),
]
HAS_TRL = importlib.util.find_spec("trl") is not None

#: Wall-clock limit of one launch (process start, imports, compiling, the steps).
LAUNCH_TIMEOUT_S = 600


def _env() -> dict:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
    }


def _launch(command: list[str], out: Path) -> dict[str, dict]:
    """Run the worker once; return ``{job: result}`` from the files its rank 0 wrote to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        command + ["--out", str(out)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )
    assert proc.returncode == 0, (
        f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    )
    return {p.stem: torch.load(p, weights_only=False) for p in out.glob("*.pt")}


def _torchrun(nproc: int, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(WORKER),
        "--mode",
        "cp",
        *args,
    ]


def _jobs(*names: str) -> list[str]:
    return [a for name in names for a in ("--job", name)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, dict]:
    """The plain Trainer (and SFTTrainer) in one process, ``dp * batch`` = 4 documents per step."""
    jobs = _jobs("trainer", *(["sft"] if HAS_TRL else []))
    return _launch(
        [sys.executable, str(WORKER), "--mode", "reference", "--dp", "1", "--batch", "4", *jobs],
        tmp_path_factory.mktemp("ref"),
    )


@pytest.fixture(scope="module")
def cp2(tmp_path_factory) -> dict[str, dict]:
    """One torchrun launch of 2 processes (CP=2, 4 documents per step): every CP job and the SFT example (TRL)
    with its own arguments."""
    jobs = _jobs("trainer", *(["sft"] if HAS_TRL else []), "control", *(["example"] if HAS_TRL else []))
    return _launch(_torchrun(2, "--cp", "2", "--batch", "4", *jobs), tmp_path_factory.mktemp("cp2"))


def _assert_matches(run: dict, ref: dict, what: str) -> None:
    assert run["rewritten"] > 0 and run["all_gathers"] > 0, f"{what}: no CP attention ran ({run})"
    steps = [h["step"] for h in ref["history"]]
    assert [h["step"] for h in run["history"]] == steps and steps, f"{what}: logged steps differ"
    for mine, theirs in zip(run["history"], ref["history"]):
        msg = f"{what}, step {theirs['step']}"
        torch.testing.assert_close(mine["loss"], theirs["loss"], **LOSS_TOL, msg=lambda m: f"{msg} loss: {m}")
        torch.testing.assert_close(
            mine["grad_norm"], theirs["grad_norm"], **NORM_TOL, msg=lambda m: f"{msg} grad_norm: {m}"
        )
    assert run["params"].keys() == ref["params"].keys()
    for name, value in ref["params"].items():
        got = run["params"][name]
        torch.testing.assert_close(got, value, **TRAINER_PARAM_TOL, msg=lambda m: f"{what}, {name}: {m}")


@slow
def test_trainer_cp2_matches_one_process(cp2, reference):
    _assert_matches(cp2["trainer"], reference["trainer"], "Trainer CP=2")


@slow
def test_trainer_cp2_under_aot_eager_matches_one_process(reference, tmp_path):
    # the example's default on CPU: inside the Trainer's DDP wrapper, Dynamo's DDPOptimizer splits each graph at
    # DDP's gradient buckets (a 64 KiB first bucket makes several of the tiny model's 354 KiB), compiles each part
    # with the backend and, at compile time, runs each compiled part on fake tensors
    launch = _torchrun(2, "--cp", "2", "--batch", "4", "--inner", "aot_eager", "--first-bucket-kib", "64")
    runs = _launch([*launch, *_jobs("trainer")], tmp_path)
    _assert_matches(runs["trainer"], reference["trainer"], "Trainer CP=2, aot_eager")


@slow
@pytest.mark.skipif(not HAS_TRL, reason="TRL is an optional test dependency (pip install -c constraints.txt trl)")
def test_sft_trainer_padding_free_cp2_matches_one_process(cp2, reference):
    # TRL's padding-free collator: one packed row per micro-batch, position_ids restarting per document, and the
    # varlen keys (cu_seq_lens_*, max_length_*) that the integration drops; 2 micro-batches per optimizer step.
    _assert_matches(cp2["sft"], reference["sft"], "SFTTrainer CP=2")


@slow
def test_trainer_dp2_cp2_shuffled_matches_one_process(tmp_path):
    # 2 replicas of 2 documents each, 2 CP ranks per replica; shuffled by the Trainer's default random sampler:
    # the replicas' batches of a step together are the one-process run's 4 documents of that step
    shuffled = ("--sampling", "random", *_jobs("trainer"))
    runs = _launch(_torchrun(4, "--cp", "2", "--batch", "2", *shuffled), tmp_path / "cp")
    ref = _launch(
        [sys.executable, str(WORKER), "--mode", "reference", "--dp", "2", "--batch", "2", *shuffled], tmp_path / "ref"
    )
    assert runs["trainer"]["world"] == 4
    _assert_matches(runs["trainer"], ref["trainer"], "Trainer dp=2 x cp=2, shuffled")


@slow
def test_negative_control_fails_the_same_check(cp2, reference):
    # counting every CP rank's copy of the batch in the denominator halves the loss and the gradient
    first_step = {**reference["trainer"], "history": reference["trainer"]["history"][:1]}  # the control runs 1 step
    with pytest.raises(AssertionError, match="control, step 1 loss"):
        _assert_matches(cp2["control"], first_step, "control")


def _refusals(rank: int, world: int) -> dict:
    """The refusals on gloo ranks with the environment torchrun gives its workers (accelerate reads it)."""
    from tests import _hf_trainer_worker

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    return _hf_trainer_worker.refusal_messages()


def test_refusals_name_the_setting_and_the_fix():
    # the refusals come before any step: ranks forked from the harness's fork server, not a torchrun launch
    for messages in run_distributed(_refusals, 2, fresh=True):
        assert "eval_strategy='steps'" in messages["eval_strategy"], messages
        assert "set eval_strategy='no'" in messages["eval_strategy"], messages
        assert "label_smoothing_factor=0.1" in messages["label_smoothing"]
        assert "set label_smoothing_factor=0" in messages["label_smoothing"]
        assert "average_tokens_across_devices=False" in messages["average_tokens"]
        assert "cp_size=3 does not divide the world size 2" in messages["cp_size"]


def _without_torchrun(output_dir: str) -> str:
    from transformers import TrainingArguments

    from cpcompile.integrations.transformers import CPTrainer
    from cpcompile.testing import tiny_model

    args = TrainingArguments(output_dir=output_dir, use_cpu=True, report_to="none")
    try:
        CPTrainer(model=tiny_model("qwen3"), args=args, train_dataset=[{"input_ids": [1, 2]}], cp_size=2)
    except ValueError as e:
        return f"ValueError: {e}"
    return "no error"


def test_cp_trainer_without_torchrun_says_how_to_launch(tmp_path):
    message = run_alone(_without_torchrun, str(tmp_path))
    assert message.startswith("ValueError: CPTrainer needs torch.distributed"), message
    assert "torchrun --nproc-per-node N" in message


@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.device_count() >= 2),
    reason=(
        "Trainer(fsdp=...) needs 2 accelerator devices: accelerate 1.15 turns on FSDP only for accelerator "
        "distributed types (accelerate/state.py, AcceleratorState.__init__: the fsdp_plugin branch is under "
        "MULTI_GPU/.../MULTI_NEURON), so on CPU (MULTI_CPU) the Trainer silently runs DDP"
    ),
)
@slow
def test_trainer_fsdp_cp2_matches_one_process(reference, tmp_path):
    runs = _launch(_torchrun(2, "--cp", "2", "--batch", "4", "--fsdp", *_jobs("trainer")), tmp_path)
    assert runs["trainer"]["sharded"], "the Trainer did not shard the model with FSDP"
    _assert_matches(runs["trainer"], reference["trainer"], "Trainer FSDP CP=2")


@slow
@pytest.mark.skipif(not HAS_TRL, reason="TRL is an optional test dependency (pip install -c constraints.txt trl)")
def test_sft_example_runs_under_torchrun_and_saves_the_model(cp2):
    # examples/sft_trainer_cp.py's main, called in the CP=2 torchrun launch with the example's own arguments
    printed, saved = cp2["example"]["stdout"], Path(cp2["example"]["saved"])
    assert "CPSFTTrainer: dp=1 x cp=2, 2 steps in" in printed, printed[-3000:]
    assert Path(printed.rsplit("saved to ", 1)[1].strip()) == saved
    from transformers import AutoModelForCausalLM

    from cpcompile.testing import tiny_model

    reloaded = AutoModelForCausalLM.from_pretrained(saved)
    assert reloaded.state_dict().keys() == tiny_model("qwen3", vocab_size=128).state_dict().keys()
