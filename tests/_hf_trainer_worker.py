"""A few steps of Hugging Face ``Trainer`` / TRL ``SFTTrainer`` on a tiny Qwen3, with or without cpcompile's CP.

Launched by ``tests/test_integration_transformers.py``, as users launch training::

    torchrun --standalone --nproc-per-node 2 tests/_hf_trainer_worker.py --mode cp --cp 2 --job trainer --out DIR
    python tests/_hf_trainer_worker.py --mode reference --job trainer --out REF   # the same Trainer in one process

Both sides build the same model (seed 0) and the same documents, packed padding-free by the trainer's collator
(``DataCollatorWithFlattening``; SFTTrainer with ``padding_free=True``). Batches are taken in order
(``train_sampling_strategy="sequential"``) so that step ``k`` of every run sees the same global batch: ``dp``
replicas of ``--batch`` documents each under CP, one batch of ``dp * --batch`` documents in one process.
For every ``--job`` (see :data:`JOBS`), rank 0 writes ``--out``/JOB.pt: the Trainer's logged history, the final
parameters, and how many SDPA sites were rewritten and K/V all-gathers ran in the last step.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

VOCAB = 128


def documents(n: int, seed: int = 0) -> list[dict[str, list[int]]]:
    """``n`` documents of 5-40 random tokens (ids 3..VOCAB-1; 0-2 are pad/bos/eos of the tokenizer)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(5, 41, (n,), generator=g).tolist()
    return [{"input_ids": torch.randint(3, VOCAB, (k,), generator=g).tolist()} for k in lens]


def tokenizer():
    """A word-level tokenizer over the tiny vocabulary, built in memory (SFTTrainer needs one for its pad id)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


#: name -> (trainer, gradient accumulation steps, optimizer steps, negative control)
JOBS = {
    "trainer": ("trainer", 1, 2, None),  # transformers.Trainer, DataCollatorWithFlattening
    "sft": ("sft", 2, 2, None),  # TRL SFTTrainer, padding_free=True, 2 micro-batches per step
    # negative control: the loss denominator counts every CP rank's copy of the batch (get_cp_size() -> 1)
    "control": ("trainer", 1, 1, "cp-count"),
}


def run_job(name: str, a: argparse.Namespace) -> None:
    import transformers
    from torch.distributed.tensor import DTensor
    from transformers import DataCollatorWithFlattening, TrainingArguments

    import cpcompile
    from cpcompile.testing import tiny_model

    kind, grad_accum, steps, control = JOBS[name]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = world // a.cp if a.mode == "cp" else a.dp
    batch = a.batch if a.mode == "cp" else a.batch * a.dp
    model = tiny_model("qwen3", seed=0, vocab_size=VOCAB)
    common = dict(
        output_dir=tempfile.mkdtemp(prefix="hf-trainer-"),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=grad_accum,
        max_steps=steps,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,  # the tiny random model's norm is above 1: clipping is active
        optim="adamw_torch",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        train_sampling_strategy=a.sampling,
        dataloader_num_workers=0,
        disable_tqdm=True,
        ddp_timeout=180,
        seed=0,
    )
    if a.fsdp:
        common.update(fsdp="full_shard", fsdp_config={"version": 2})
    train = documents(a.batch * dp * grad_accum * steps)
    if kind == "trainer":
        kwargs = dict(args=TrainingArguments(**common), train_dataset=train, data_collator=DataCollatorWithFlattening())
        base = transformers.Trainer
    else:
        import datasets
        from trl import SFTConfig, SFTTrainer

        kwargs = dict(  # bf16=False: SFTConfig defaults to bf16 autocast, this compares fp32 runs
            args=SFTConfig(**common, padding_free=True, max_length=None, packing=False, bf16=False),
            train_dataset=datasets.Dataset.from_list(train),
            processing_class=tokenizer(),
        )
        base = SFTTrainer
    if a.mode == "cp":
        from cpcompile.integrations.transformers import ContextParallelMixin

        cls = type(f"CP{base.__name__}", (ContextParallelMixin, base), {})
        if control == "cp-count":
            cls.get_cp_size = lambda self: 1
        trainer = cls(model=model, cp_size=a.cp, cp_backend_kwargs={"inner": a.inner}, **kwargs)
    else:
        trainer = base(model=model, **kwargs)
    rewritten_before = cpcompile.passes.counters["sdpa_rewritten"]
    trainer.train()
    params = {  # full_tensor() is a collective: every rank calls it
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
        for n, p in trainer.model.named_parameters()
    }
    result = {
        "history": [h for h in trainer.state.log_history if "loss" in h],
        "params": params,
        "world": world,
        "sharded": any(isinstance(p, DTensor) for p in trainer.model.parameters()),
        "rewritten": cpcompile.passes.counters["sdpa_rewritten"] - rewritten_before,
        "all_gathers": cpcompile.comm_stats().all_gathers if a.mode == "cp" else 0,
    }
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(result, os.path.join(a.out, f"{name}.pt"))


#: refusal case -> (TrainingArguments overrides, cp_size)
REFUSALS = {
    "eval_strategy": ({"eval_strategy": "steps", "eval_steps": 1}, 2),
    "label_smoothing": ({"label_smoothing_factor": 0.1}, 2),
    "average_tokens": ({"average_tokens_across_devices": False}, 2),
    "cp_size": ({}, 3),
}


def refusal_messages() -> dict[str, str]:
    """Build the CP trainer with each refused setting; return {case: error message}."""
    from transformers import DataCollatorWithFlattening, TrainingArguments

    from cpcompile.integrations.transformers import CPTrainer
    from cpcompile.testing import tiny_model

    messages = {}
    for case, (overrides, cp_size) in REFUSALS.items():
        with tempfile.TemporaryDirectory(prefix="hf-trainer-") as out:
            args = TrainingArguments(output_dir=out, use_cpu=True, report_to="none", **overrides)
            docs = documents(4)
            try:
                CPTrainer(
                    model=tiny_model("qwen3", seed=0, vocab_size=VOCAB),
                    args=args,
                    train_dataset=docs,
                    eval_dataset=docs,
                    data_collator=DataCollatorWithFlattening(),
                    cp_size=cp_size,
                )
                messages[case] = "no error"
            except ValueError as e:
                messages[case] = str(e)
    return messages


def run_example(a: argparse.Namespace) -> None:
    """``examples/sft_trainer_cp.py``'s ``main`` in this torchrun launch (its own arguments, 2 steps); rank 0
    writes what it printed and where it saved the model to ``example.pt``."""
    import contextlib
    import importlib.util
    import io
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "sft_trainer_cp.py"
    spec = importlib.util.spec_from_file_location("sft_trainer_cp", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    saved = os.path.join(a.out, "example_model")
    # another model configuration than the jobs before (head_dim): its float attributes would otherwise come back
    # symbolic from Dynamo's recompile, which cpcompile refuses (the refusal names this fix)
    torch.compiler.reset()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        example.main(["--steps", "2", "--batch", "4", "--max-prompt", "16", "--inner", a.inner, "--output-dir", saved])
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({"stdout": printed.getvalue(), "saved": saved}, os.path.join(a.out, "example.pt"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["cp", "reference"], required=True)
    p.add_argument(
        "--job",
        choices=[*sorted(JOBS), "example"],
        action="append",
        required=True,
        help="run these, in order",
    )
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--dp", type=int, default=1, help="reference only: the CP run's data-parallel size")
    p.add_argument("--batch", type=int, default=4, help="documents per data-parallel replica and micro-batch")
    p.add_argument("--inner", default="eager", help="cpcompile inner compiler (the rewritten graph as traced)")
    p.add_argument("--sampling", default="sequential", choices=["sequential", "random"], help="train_sampling_strategy")
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (the Trainer's fsdp option) instead of DDP")
    p.add_argument(
        "--first-bucket-kib",
        type=int,
        default=None,
        help="DDP's first gradient bucket (default 1 MiB, more than the tiny model): smaller makes Dynamo's "
        "DDPOptimizer split each graph into several compiled buckets",
    )
    p.add_argument("--out", required=True, help="folder: rank 0 writes JOB.pt per job")
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.first_bucket_kib is not None:  # read by DDP and by DDPOptimizer when they are built (torch 2.13, private)
        torch.distributed._DEFAULT_FIRST_BUCKET_BYTES = a.first_bucket_kib * 1024
    if a.mode == "cp":  # gloo with one worker thread per group (cpcompile.runtime.gloo); the Trainer keeps it
        import torch.distributed as dist

        import cpcompile

        dist.init_process_group(cpcompile.gloo_backend())
    import transformers

    transformers.logging.set_verbosity_error()
    for name in a.job:
        {"example": run_example}.get(name, lambda a: run_job(name, a))(a)


if __name__ == "__main__":
    main()
