"""Supervised fine-tuning with context parallelism through TRL's SFTTrainer or transformers' Trainer.

A small Qwen3-style model (random init) learns to reverse random token sequences: each example is a prompt and
its reversed completion, the loss is on the completion only, and examples are packed padding-free into rows
(``position_ids`` restart at every example). Every row is split over the CP ranks by cpcompile; the trainer's
own machinery (DDP, gradient accumulation, clipping, logging, progress bar) is unchanged.

    torchrun --standalone --nproc-per-node 2 examples/sft_trainer_cp.py                  # CP=2 on CPU (gloo)
    torchrun --standalone --nproc-per-node 4 examples/sft_trainer_cp.py --cp 2           # dp=2 x cp=2
    torchrun --standalone --nproc-per-node 2 examples/sft_trainer_cp.py --trainer hf     # transformers.Trainer

``--trainer trl`` (default) needs ``pip install trl``; ``--trainer hf`` uses ``DataCollatorWithFlattening``.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile

import torch
import torch.distributed as dist

import cpcompile
from cpcompile.integrations.transformers import ContextParallelMixin, CPTrainer
from cpcompile.testing import tiny_model

VOCAB = 128  # ids 0-2: <pad>, <bos>, <eos>; words t3 .. t127


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trainer", choices=["trl", "hf"], default="trl", help="TRL SFTTrainer (default) or Trainer")
    p.add_argument("--cp", type=int, default=2, help="ranks per context-parallel group (default 2)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    p.add_argument("--batch", type=int, default=8, help="examples per step and data-parallel replica (default 8)")
    p.add_argument("--max-prompt", type=int, default=48, help="longest prompt in tokens (default 48)")
    p.add_argument("--inner", default=None, help="cpcompile inner compiler (default: aot_eager on CPU, else inductor)")
    p.add_argument("--output-dir", default=None, help="checkpoints (default: a temporary folder)")
    return p.parse_args(argv)


def examples(n: int, max_prompt: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """``n`` (prompt, completion) pairs of token ids: a random prompt and the same tokens reversed, then <eos>."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(4, max_prompt))]
        pairs.append((prompt, prompt[::-1] + [2]))
    return pairs


def tokenizer():
    """A word-level tokenizer over ``<pad> <bos> <eos> t3 .. t127``, built in memory (no download)."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun, e.g. torchrun --standalone --nproc-per-node 2 " + __file__)
    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
        # gloo with one worker thread per group (cpcompile.runtime.gloo); the Trainer keeps a group it finds
        if not dist.is_initialized():
            dist.init_process_group(cpcompile.gloo_backend())
    world = int(os.environ["WORLD_SIZE"])
    if world % args.cp:
        raise SystemExit(f"--cp {args.cp} must divide the number of processes {world}")
    pairs = examples(args.steps * args.batch * (world // args.cp), args.max_prompt)
    model = tiny_model("qwen3", seed=0, vocab_size=VOCAB, hidden_size=128, intermediate_size=384, head_dim=32)
    common = dict(
        output_dir=args.output_dir or tempfile.mkdtemp(prefix="sft-cp-"),
        per_device_train_batch_size=args.batch,  # per data-parallel replica: its CP ranks share the batch
        max_steps=args.steps,
        learning_rate=3e-3,
        warmup_steps=2,
        logging_steps=min(5, args.steps),
        save_strategy="no",
        report_to="none",
        use_cpu=not cuda,
        bf16=cuda,
    )
    backend = {"inner": args.inner or ("inductor" if cuda else "aot_eager")}

    if args.trainer == "trl":
        import datasets
        from trl import SFTConfig, SFTTrainer

        def words(ids):
            return " ".join(f"t{i}" if i > 2 else "<eos>" for i in ids)

        data = datasets.Dataset.from_list([{"prompt": words(p), "completion": " " + words(c)} for p, c in pairs])

        class CPSFTTrainer(ContextParallelMixin, SFTTrainer):
            pass

        config = SFTConfig(**common, padding_free=True, max_length=None, completion_only_loss=True)
        trainer = CPSFTTrainer(
            model=model, args=config, train_dataset=data, processing_class=tokenizer(), cp_size=args.cp,
            cp_backend_kwargs=backend,
        )  # fmt: skip
    else:
        from transformers import DataCollatorWithFlattening, TrainingArguments

        data = [{"input_ids": p + c, "labels": [-100] * len(p) + c} for p, c in pairs]  # loss on the completion
        trainer = CPTrainer(
            model=model,
            args=TrainingArguments(**common),
            train_dataset=data,
            data_collator=DataCollatorWithFlattening(),
            cp_size=args.cp,
            cp_backend_kwargs=backend,
        )
    result = trainer.train()
    trainer.save_model()  # the model's own weights (state_dict names unchanged by compiling in place)
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print(
            f"{type(trainer).__name__}: dp={world // args.cp} x cp={args.cp}, {args.steps} steps in "
            f"{result.metrics['train_runtime']:.1f} s; logged loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
            f"saved to {trainer.args.output_dir}"
        )


if __name__ == "__main__":
    main()
