"""`python -m specbench ...` (and `torchrun --nproc-per-node N -m specbench run ...`)."""

from specbench.cli import main

main()
