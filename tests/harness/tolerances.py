"""Every tolerance of the test suite, each named and justified: the one place (parity, kernels, training runs)."""

# fp32 model-level parity (CP ranks vs one process, every attention path and layout). The CP side computes the
# same attention over the same keys; only the order of float reductions changes: the softmax/matmul blocking
# over a shorter query chunk (or the block kernel's online softmax), the loss and every gradient summed over
# ranks instead of over one row. Measured maxima over every parity run of the suite are in BENCHMARKS.md
# ("parity errors": logits 6.0e-7, loss 9.5e-7, gradients 2.3e-7); each tolerance below leaves >= 4x headroom
# over them and stays far below what one wrong mask entry, a wrong label at a chunk boundary or a missing
# rank's gradient causes (>= 5e-3, measured by the negative controls).
#: Logits are O(1) values: a few fp32 ulps plus reassociation over a few hundred keys.
LOGITS_TOL = dict(atol=1e-5, rtol=1e-5)
#: The loss is one scalar of size ~5, a sum of per-rank partial sums: a few ulps (1 ulp = 4.8e-7 at 5).
LOSS_TOL = dict(atol=1e-6, rtol=1e-6)
#: Gradients are small (|g| ~1e-3..1e-1): an absolute 1e-6 keeps the relative check meaningful.
GRAD_TOL = dict(atol=1e-6, rtol=1e-5)
#: torchtitan's MoE experts multiply in bf16 (its ``GroupedExperts``), and a bf16 product's rounding depends on how
#: many rows its expert gets (``torch._grouped_mm``'s blocking): a CP rank's experts get its tokens only. Measured
#: at CP=2 and 3 (tests/test_moe.py, Qwen3-MoE, 2 layers): logits 1.0e-4, gradients <= 2.3e-5, loss 4.8e-7, the same
#: with the rest of the model in fp64 (the experts stay bf16). ~10x headroom; still 5x below what the negative
#: controls of the fp32 tolerances measure (>= 5e-3).
BF16_EXPERTS_LOGITS_TOL = dict(atol=1e-3, rtol=1e-3)
BF16_EXPERTS_GRAD_TOL = dict(atol=2e-4, rtol=1e-3)
#: The global gradient norm (FSDP2 ``clip_grad_norm_``, the Trainer's logged norm of ~1.3-2.2): a sum of squares
#: of gradients that agree to GRAD_TOL (measured <= 2.4e-7).
NORM_TOL = dict(atol=1e-6, rtol=1e-5)
#: Parameters after a few AdamW steps (lr 1e-2, eps 1e-4, tests/test_fsdp_cp.py): AdamW divides by
#: sqrt(v) + eps, so a gradient difference delta moves a step by up to 2 * lr * delta / eps = 2e-5 even for a
#: zero gradient. A wrong CP gradient combination moves parameters by ~lr = 1e-2.
PARAM_TOL = dict(atol=2e-5, rtol=1e-5)
#: Parameters after 2 AdamW steps of the Trainer tests (lr 1e-3, eps 1e-8): AdamW divides by sqrt(v) + eps, which
#: magnifies the fp32 rounding of gradient entries near zero (a flipped sign moves an entry by up to 2 * lr =
#: 2e-3); measured <= 2.0e-5. A wrong gradient contribution moves the first-step grad norm by a factor.
TRAINER_PARAM_TOL = dict(atol=1e-4, rtol=0)
#: One fp32 reduction of a few dozen values in another order, no CP involved (gradient norms of DTensors).
REDUCTION_TOL = dict(atol=0.0, rtol=1e-6)
#: The largest |difference| examples/train_fsdp_cp.py's own ``--check`` prints for a loss (~7) or a grad norm
#: (~0.6) over its steps: fp32 values added up in another order, a few ulps of ~5e-7 each.
SCALAR_ATOL = 5e-6
#: The block kernel alone against fp64 SDPA under the plan's mask: blockwise online softmax in fp32 over a few
#: hundred keys, a few fp32 ulps of O(1) values.
KERNEL_TOL = dict(atol=2e-5, rtol=2e-5)
#: Two fp64 computations of the same attention that differ only in summation order (the varlen segments).
FP64_TOL = dict(atol=1e-12, rtol=1e-12)
#: Autograd of an elementwise fp32 function against its closed form: a few ulps.
ELEMENTWISE_TOL = dict(atol=1e-6, rtol=1e-6)
#: Copies and reorderings (gather, the dense reference path's identical SDPA call): bit-identical.
EXACT = dict(atol=0, rtol=0)
#: examples/demo_cp.py, CP=2 vs one process, per-step loss (~4.87): step 0 differs only by fp32 reduction order
#: (measured 1.4e-6); later steps follow AdamW updates, which magnify rounding on near-zero gradients. A wrong
#: mask moves the loss by >= 5e-3 (the merge_documents controls).
DEMO_LOSS_ATOL = 1e-4
#: examples/demo_cp.py: largest parameter difference after its AdamW steps (measured 1.3e-4; a wrong gradient
#: flips updates of 2 * lr).
DEMO_PARAM_ATOL = 1e-3
#: Per-token log-probs of RL losses (``cpcompile.token_logprobs``, gathered; values ~ -5) at every forward of a
#: multi-step run (tests/test_rl_step.py, lr 1e-2, eps 1e-4): the logits' fp32 reordering, plus what the parameters'
#: differences after up to 5 AdamW steps (measured <= 9.1e-7) move them. Measured <= 4.8e-6 at CP=2 and 3 (6 steps,
#: aot_eager); a wrong mask entry moves the logits, and so the log-probs, by >= 5e-3 (the LOGITS_TOL controls).
LOGPROB_TOL = dict(atol=1e-5, rtol=1e-5)
#: The gated delta rule run per run of the sequence from the state ``[0 | I]``, the runs' summaries folded and each
#: run's output corrected (cpcompile.cores state passing), against the core on the whole sequence, fp32: the same
#: recurrence with its state products associated differently (``(A_t...A_1) S_in`` instead of ``A_t(...(A_1 S_in))``).
#: Measured 6.0e-8 in tests/test_state_passing.py (>= 10x headroom); a run without its incoming state is off by
#: 1.7e-1 there. The RG-LRU's diagonal recurrence by the same fold: 2.4e-7 there (its state sums its inputs
#: unnormalised, outputs of up to ~5; 4x headroom), 4.3 without the incoming state.
STATE_FOLD_TOL = dict(atol=1e-6, rtol=1e-6)
#: Mamba2's SSD by the same state passing (``[0 ; I]`` start, fold, correction) against the core on the whole
#: sequence, fp32: the decays' products associated differently, on outputs of up to ~20 (the SSD sums ``dt x B C``
#: along the sequence unnormalised). Measured 1.9e-6 max abs (4.4e-7 relative where |y| > 1) in
#: tests/test_state_passing.py, 0.03 of this bound; a run without its incoming state is off by 3.3 there.
SSD_STATE_FOLD_TOL = dict(atol=1e-5, rtol=1e-5)
