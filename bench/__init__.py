"""The benchmarks: attotron beside PyTorch's own implementations, and measurements beside formulas.

Run them from the repository root as modules, which makes the root (the library) importable:
    python -m bench.bench --only sft                       # one process
    torchrun --nproc_per_node 4 -m bench.bench --model tiny --steps 40 --only dp,zero,tp,cp,pp,ac
    python -m bench.bench_mfu                               # the GPU check: speed, MFU (one GPU)
    python -m bench.bench_gpu                               # the GPU check: kernel numerics (one GPU)
    python -m bench.bench_theory --model 1b --dp 8 --zero 3 --ac
    python -m bench.bench_ckpt --repeat 5
    python -m bench.bench_heldout out/sft out/grpo        # the GRPO demo, question by question
    python -m bench.bench_generate                          # generate vs transformers' (tokens/s)
Each also runs by path (`python bench/bench.py ...`): its first lines put the root on sys.path.
A report is printed; it is written to a file only when asked (`--out FILE`).
docs/benchmarks.md holds the measured tables, each with the command that printed it.
"""
